"""`python -m eqrope.serve CHECKPOINT_DIR`: serve a Hugging Face checkpoint over OpenAI's API.

    python -m eqrope.serve ./SmolLM2-135M-Instruct --port 8000 --slots 8 --max-len 2048

It loads the weights (`eqrope.from_hf`), the tokenizer and chat template
(`eqrope.Tokenizer.from_pretrained`) and the sampling defaults of `generation_config.json`,
compiles the engine's programs, then serves `/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/tokenize`, `/detokenize`, `/tokenizer_info`, `/health` and `/metrics` with
uvicorn. SIGTERM or Ctrl-C stops taking requests, lets those in flight finish for at most
`--drain-timeout` seconds, and exits 0. Needs the `[serve]` extra:
`pip install "eqrope[serve]"`. docs/serving.md shows it with curl, the `openai` client and
lm-eval.

With `--mesh DATA,MODEL` the engine runs on that mesh of the devices; with
`--coordinator HOST:PORT --num-processes N --process-id I` as one of N processes joined by
`jax.distributed` on a mesh over all of them: process 0 serves HTTP, the others run the
same engine's device calls (`eqrope.serving.follow`) until it stops.
"""

import argparse
import json
import logging
import signal
import sys
from pathlib import Path


# The sampling fields of generation_config.json that become the server's defaults (vLLM's
# `--generation-config auto` reads the same ones), under their GenerationConfig names.
_DEFAULTS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_new",
}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eqrope.serve", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=8, help="samples decoded at once (the engine's slots)")
    p.add_argument("--max-len", type=int, default=None, help="positions of one sample, prompt plus completion (default: the model's)")
    p.add_argument("--page-size", type=int, default=16, help="positions per page of the key/value pool")
    p.add_argument("--prefill-chunk", type=int, default=64, help="the longest prompt piece one prefill call computes")
    p.add_argument("--decode-steps", type=int, default=16, help="the most decode steps of one compiled chunk")
    p.add_argument("--max-waiting", type=int, default=64, help="samples held beyond the slots before answering 503")
    p.add_argument("--served-model-name", default=None, help="the model's name in requests (default: the folder's name)")
    p.add_argument("--api-key", default=None, help="ask every /v1 request for 'Authorization: Bearer KEY'")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the weights' dtype (auto: the checkpoint's)")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish the requests in flight on SIGTERM")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True, help="compile every engine program before serving")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--constraint-capacity", type=_pair, default=None, metavar="STATES,EXCEPTIONS",
                   help="serve response_format and structured_outputs: the engine's table of the running "
                   "requests' automata (e.g. 4096,65536; needs the [structured] extra)")
    p.add_argument("--structured-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="how long a request waits for its schema's compile before a 408 (default: 10)")
    p.add_argument("--mesh", type=_pair, default=None, metavar="DATA,MODEL",
                   help="run the engine on a (data, model) mesh of the devices (of every process)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="join a jax.distributed job (process 0's address)")
    p.add_argument("--num-processes", type=int, default=1, help="processes of the jax.distributed job")
    p.add_argument("--process-id", type=int, default=0, help="this process's index: 0 serves HTTP, the others follow")
    return p


def _pair(text: str) -> tuple[int, int]:
    try:
        first, second = (int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes two ints, like 8,1 (--mesh DATA,MODEL) or 4096,65536 "
                                         f"(--constraint-capacity STATES,EXCEPTIONS), got {text!r}") from None  # fmt: skip
    return first, second


def defaults_of(folder: Path) -> dict:
    """The sampling defaults that `generation_config.json` sets, checked by
    `GenerationConfig.from_pretrained` (which refuses a bad file by name)."""
    from .generation import GenerationConfig

    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    checked = GenerationConfig.from_pretrained(file)
    raw = json.loads(file.read_text())
    out = {ours: getattr(checked, ours) for theirs, ours in _DEFAULTS.items() if raw.get(theirs) is not None}
    if "top_k" in out and out["top_k"] is None:  # `top_k: 0` reads as None: off, the server's -1
        out["top_k"] = -1
    return out


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        import uvicorn

        from .serving.server._app import build_app
        from .serving.server._server import Server
    except ImportError as e:
        raise SystemExit(
            f"python -m eqrope.serve needs the [serve] extra ({e.name} is missing): "
            'pip install "eqrope[serve]"'
        ) from e
    import jax
    import jax.numpy as jnp

    from ._checks import check_path
    from .sharding import make_mesh
    from .text import Tokenizer
    from .weights import from_hf

    # The engine's thread and the HTTP loop share the GIL: a thread that wants it waits
    # up to the switch interval (5 ms by default) for the other to drop it. A short one
    # lets a first token leave soon after its step (measured: 1-2 ms of first-token time).
    sys.setswitchinterval(0.0005)
    if args.coordinator is not None:
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    elif args.num_processes != 1 or args.process_id != 0:
        raise SystemExit("python -m eqrope.serve: --num-processes and --process-id need --coordinator HOST:PORT.")
    if jax.process_count() > 1 and args.mesh is None:
        raise SystemExit("python -m eqrope.serve: several processes share one engine on a mesh; pass --mesh DATA,MODEL.")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    folder = check_path(args.checkpoint, "CHECKPOINT_DIR")
    if not folder.is_dir():
        raise SystemExit(f"python -m eqrope.serve: {folder} is not a directory; pass a checkpoint's folder.")
    dtype = None if args.dtype == "auto" else getattr(jnp, args.dtype)
    model = from_hf(folder, dtype=dtype)
    tokenizer = Tokenizer.from_pretrained(folder)
    name = args.served_model_name or folder.resolve().name
    try:
        mesh = None if args.mesh is None else make_mesh(*args.mesh)
        if jax.process_index() != 0:
            return _follow(model, args, mesh)
        server = Server(
            model, tokenizer, name=name, source=str(folder), slots=args.slots, max_len=args.max_len,
            page_size=args.page_size, prefill_chunk=args.prefill_chunk, decode_steps=args.decode_steps,
            max_waiting=args.max_waiting, api_key=args.api_key, defaults=defaults_of(folder),
            warmup=args.warmup, mesh=mesh, constraint_capacity=args.constraint_capacity,
            structured_timeout=args.structured_timeout,
        )  # fmt: skip
    except (ValueError, ImportError) as e:
        raise SystemExit(f"python -m eqrope.serve: {e}") from None
    logging.getLogger("eqrope.serving").info("serving %s on http://%s:%d/v1", name, args.host, args.port)
    # uvicorn drains on SIGTERM and SIGINT, then raises the signal again to end the
    # process by it; a drained server has done what it was asked: exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.run(
        build_app(server), host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.drain_timeout,
    )  # fmt: skip
    server.close()


def _follow(model, args, mesh) -> None:
    """A process other than 0: the server's engine, its device calls made as process 0 makes them."""
    import jax

    from .serving import Engine, follow
    from .serving.server._server import engine_arguments

    engine_args = engine_arguments(
        model, args.slots, args.max_len, args.page_size, args.prefill_chunk, args.decode_steps, args.max_waiting, mesh
    )
    make = lambda: Engine(model, **engine_args)
    logging.getLogger("eqrope.serving").info("process %d follows process 0's engine", jax.process_index())
    follow(make(), rebuild=make)


if __name__ == "__main__":
    main(sys.argv[1:])
