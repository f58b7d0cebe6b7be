"""Issue 44, item 6: the logging recipe turns on eqrope's logger alone.

`logging.basicConfig(level=logging.INFO)` shows every library's INFO lines, JAX's
"Unable to initialize backend 'tpu'" among them; `eqrope.enable_logging()` shows
eqrope's lines and nothing else.
"""

import io
import logging
import pathlib
import subprocess
import sys

import numpy as np
from _models import random_model

import eqrope


SCRIPT = """
import logging, sys
sys.path.insert(0, {tests!r})
import numpy as np
import eqrope
from _models import random_model
{setup}
eqrope.generate(random_model(0, 19, 16, 2, 1, 16), np.arange(3, dtype=np.int32), 2)
"""


def stderr_lines(setup: str) -> list[str]:
    """The standard error of a fresh process that runs `setup`, then one `generate`."""
    code = SCRIPT.format(tests=str(pathlib.Path(__file__).parent), setup=setup)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stderr.splitlines() if line.strip()]


def test_enable_logging_shows_eqropes_lines_alone():
    lines = stderr_lines("eqrope.enable_logging()")
    assert lines == [
        "eqrope.generation: compiling generate: batch 1, cache length 16 (a new batch, cache "
        "length, num_samples or static setting compiles once; later calls reuse it)"
    ]
    # basicConfig, the recipe it replaces, shows the same line among JAX's own (where
    # libtpu is not installed, "Unable to initialize backend 'tpu'").
    everything = stderr_lines("logging.basicConfig(level=logging.INFO)")
    assert "INFO:eqrope.generation:compiling generate: batch 1, cache length 16" in "\n".join(everything)
    assert any(line.startswith("INFO:jax") for line in everything)


def test_enable_logging_twice_keeps_one_handler_and_can_be_undone():
    logger = logging.getLogger("eqrope")
    before = (list(logger.handlers), logger.level)
    first, second = io.StringIO(), io.StringIO()
    try:
        handler = eqrope.enable_logging(stream=first)
        assert eqrope.enable_logging("DEBUG", stream=second) is handler
        assert logger.handlers.count(handler) == 1 and logger.level == logging.DEBUG
        eqrope.generate(random_model(1, 37, 16, 2, 1, 16), np.arange(3, dtype=np.int32), 2)
        assert first.getvalue() == ""
        assert second.getvalue().startswith("eqrope.generation: compiling generate: batch 1")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before[1])
    assert (list(logger.handlers), logger.level) == before
