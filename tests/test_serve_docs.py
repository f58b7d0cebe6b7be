"""The shell commands of docs/serving.md's server section, run as written against a live
server: the `python -m eqrope.serve` line starts it (on a free port, a small checkpoint),
then each `curl` line and the `lm_eval` line run in bash, with the address, the
checkpoint's name and lm-eval's task (a local one: nothing is downloaded) put in.

Needs the `[serve]` extra and curl (skipped without them).
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _serve import serve, write_checkpoint


pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "serving.md").read_text()
SECTION = PAGE.split("## Serving over HTTP", 1)[1].split("\n## ", 1)[0]
START, SHELL = [block.split("```", 1)[0] for block in SECTION.split("```bash\n")[1:3]]


def commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined."""
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("docs") / "my-checkpoint", max_len=128)
    (line,) = [c for c in commands(START) if "eqrope.serve" in c]
    args = shlex.split(line)[4:]  # after `python -m eqrope.serve ./my-checkpoint`
    assert args[:2] == ["--port", "8000"], args
    # The small checkpoint's length, and test_serve.py's slots: the servers of both modules
    # compile the same programs, which the session's cache keeps (tests/_serve.py).
    small = {"--max-len": "128", "--slots": "4"}
    args = [small.get(flag, a) for flag, a in zip(["", *args[2:]], args[2:])]
    with serve(checkpoint, *args, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def run(command: str, server, **kwargs) -> subprocess.CompletedProcess:
    command = command.replace("http://127.0.0.1:8000", server.url)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **kwargs.pop("env", {})}
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, env=env, **kwargs)


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_the_curl_commands_answer(server):
    curls = [c for c in commands(SHELL) if c.startswith("curl")]
    assert len(curls) == 4
    outputs = []
    for command in curls:
        done = run(command, server)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert '"object":"text_completion"' in outputs[0] and '"usage"' in outputs[0]
    assert '"object":"chat.completion"' in outputs[1]
    assert outputs[2].rstrip().endswith("data: [DONE]") and outputs[2].startswith("data: {")
    assert re.match(r'eqrope_requests_running\{model_name="my-checkpoint"\} 0\.0', outputs[3])


def test_the_lm_eval_command_runs(server, offline):
    pytest.importorskip("lm_eval")
    (command,) = [c for c in commands(SHELL) if c.startswith("lm_eval")]
    assert "--tasks hellaswag" in command
    local = command.replace("--tasks hellaswag", "--tasks eqrope_until --include_path tests/data/lm_eval --limit 2")
    done = run(local, server, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eqrope_until" in done.stdout and "exact_match" in done.stdout


def test_the_page_shows_the_committed_runs_table():
    """docs/serving.md's server table is bench/_http.py's table of the committed run."""
    import json

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import _http
    finally:
        sys.path.remove(str(ROOT / "bench"))
    result = json.loads((ROOT / "bench" / "results" / "serve_http_cpu.json").read_text())
    assert _http.docs_table(result) in SECTION
    assert f"+{result['first_token']['difference_ms']:.1f}" in SECTION
    assert result["machine"]["date"][:10] in SECTION
