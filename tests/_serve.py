"""A small checkpoint as a user has one, and `python -m eqrope.serve` on it as a real process.

The checkpoint is written without torch: a byte-level BPE tokenizer trained here with the
`tokenizers` package (special tokens `<s>` `</s>` `<pad>`, a chat template), a random
Llama-family `eqrope.RotaryDecoder` written with `eqrope.to_hf`, and a
`generation_config.json`. The server listens on 127.0.0.1 on a free port, and is stopped
with SIGTERM by the test that started it.

The servers of one pytest session share JAX's persistent compilation cache, in a folder of
the session's temporary root (all xdist workers' servers see the same one): most of a
server's start is compiling the engine's programs, and servers started with the same
checkpoint shapes and engine flags (`--slots`, `--max-len`, ...) compile the same ones.
Only the server processes use it, never the test process.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import eqrope

from _models import random_model


TEXTS = [
    "The cat sat on the mat. The dog sat on the log.",
    "One, two, three, four, five. Six, seven, eight.",
    "héllo wörld, naïve café; 日本語のテキスト 🙂 emoji.",
    "Question: What color is the sky?\nAnswer: blue\n",
    'JSON: {"name": "eqrope", "ok": true, "n": 42}',
]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_level_bpe(vocab_size: int, texts: list[str]):
    """A `tokenizers.Tokenizer`: byte-level BPE of at most `vocab_size` tokens (the 256
    bytes, the specials `<s>`, `</s>`, `<pad>` as ids 0-2, and merges learnt from `texts`)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = tokenizers.Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    raw.train_from_iterator(texts, trainer)
    return raw


def write_checkpoint(folder: Path, *, max_len: int = 128, seed: int = 0) -> Path:
    """Write the checkpoint into `folder`; **returns** it."""
    from tokenizers import processors

    raw = byte_level_bpe(320, TEXTS * 4)
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    vocab = raw.get_vocab_size()
    model = random_model(seed, vocab_size=vocab, d_model=64, n_heads=4, n_blocks=2, max_len=max_len)
    eqrope.to_hf(model, folder, drop_head_bias=True)
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))  # fmt: skip
    config = json.loads((folder / "config.json").read_text())
    config.update(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return folder


def session_cache(log_dir: Path) -> Path | None:
    """JAX's compilation cache folder for the servers of this pytest session: `xla-cache`
    in the session's temporary root above `log_dir` (the parent of an xdist worker's
    `popen-gw*` folder, else the `pytest-N` folder), or `None` outside one."""
    parents = log_dir.resolve().parents
    roots = [p.parent for p in parents if p.name.startswith("popen-gw")]
    roots = roots or [p for p in parents if p.name.startswith("pytest-") and p.parent.name.startswith("pytest-of-")]
    return roots[0] / "xla-cache" if roots else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A running server process: `url`, `port`, `process`, and its log file."""

    def __init__(self, process: subprocess.Popen, port: int, log: Path):
        self.process, self.port, self.log = process, port, log
        self.url = f"http://127.0.0.1:{port}"

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; **returns** the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"the server did not exit within {timeout} s of SIGTERM:\n{self.text()}") from None

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def serve(checkpoint: Path, *args: str, log_dir: Path, timeout: float = 240.0):
    """Start `python -m eqrope.serve checkpoint *args` on a free port; yield a `Served`
    once `/health` answers 200; SIGTERM it at the end."""
    port = free_port()
    log = log_dir / f"server-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cache = session_cache(log_dir)
    if cache is not None:  # JAX's cache is safe for concurrent writers
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "eqrope.serve", str(checkpoint), "--port", str(port), *args],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    served = Served(process, port, log)
    try:
        deadline = time.monotonic() + timeout
        # One client for all the polls (each `httpx.get` builds a client, and its TLS
        # context costs ~25 ms of CPU: seconds over a server's start).
        with httpx.Client(timeout=2) as poll:
            while True:
                if process.poll() is not None:
                    raise AssertionError(f"the server exited with {process.returncode}:\n{served.text()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"the server did not answer /health within {timeout} s:\n{served.text()}")
                try:
                    if poll.get(served.url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        yield served
    finally:
        served.stop()
