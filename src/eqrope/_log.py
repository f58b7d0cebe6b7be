"""eqrope's log lines (which program compiles, for which shapes) and its warnings.

A first call can take tens of seconds on a small machine, all of it compiling. Each
compiled program of eqrope calls `compiling` inside the function that JAX traces, so the
line is written exactly when JAX traces the program (a new shape or static setting), which
is when XLA compiles it (or reads it from a persistent compilation cache), and never on a
call that reuses the compiled program.

The loggers are `"eqrope"` and its children (`"eqrope.generation"`, `"eqrope.training"`,
...). eqrope adds a `logging.NullHandler` and configures nothing else, so the lines show
only where the application asks: `eqrope.enable_logging()` shows eqrope's alone, on
standard error; `logging.basicConfig(level=logging.INFO)` shows every library's INFO lines
(JAX's "Unable to initialize backend 'tpu'" among them).
"""

import logging
import os
import sys
import warnings

import jax
import jaxtyping


logging.getLogger("eqrope").addHandler(logging.NullHandler())


def compiling(area: str, program: str, shapes: str, new: str) -> None:
    """Log, at INFO on the logger `eqrope.{area}`, that `program` compiles for `shapes`.

    Call it inside the function being compiled (`jax.jit`, `eqx.filter_jit`): Python runs
    it only while JAX traces. `new` says what makes a new program, as in `"compiling
    generate: batch 1, cache length 128 (a new batch, cache length or num_samples compiles
    once; later calls reuse it)"`.
    """
    logging.getLogger(f"eqrope.{area}").info(
        "compiling %s: %s (a new %s compiles once; later calls reuse it)", program, shapes, new
    )


def shapes_of(*arrays) -> str:
    """The dtypes and shapes of the arrays among `arrays` (pytrees), as `int32[8,32]`."""
    leaves = [x for x in jax.tree.leaves(arrays) if hasattr(x, "shape") and hasattr(x, "dtype")]
    return ", ".join(f"{x.dtype}[{','.join(map(str, x.shape))}]" for x in leaves) or "no arrays"


_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# The runtime type checks of the tests wrap every function of eqrope in these.
_WRAPPERS = (os.path.dirname(jaxtyping.__file__), "<@beartype")


def warn(message: str, category: type[Warning]) -> None:
    """`warnings.warn` pointing at the first caller outside eqrope (the user's line)."""
    level, frame = 2, sys._getframe(1)  # stacklevel 1 is this function, 2 its caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith((_PACKAGE, *_WRAPPERS)):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


# The name of `enable_logging`'s handler, by which a second call finds it.
_HANDLER = "eqrope.enable_logging"


def enable_logging(level: int | str = logging.INFO, stream=None) -> logging.Handler:
    """Show eqrope's log lines, and no other library's, on standard error (or `stream`).

    Sets the `"eqrope"` logger to `level` and gives it a `logging.StreamHandler` that
    writes `eqrope.generation: compiling generate: batch 1, cache length 16 (...)`. The
    root logger is left alone, so JAX's own INFO lines ("Unable to initialize backend
    'tpu'", which `logging.basicConfig(level=logging.INFO)` shows) stay quiet. Calling it
    again sets that handler's level and stream instead of adding another.

    **Arguments:**

    - `level`: `logging.INFO` (the default: which program compiles) or another level,
      as a number or a name (`"DEBUG"`).
    - `stream`: where the lines go; `None` is `sys.stderr`.

    **Returns:** the handler; `logging.getLogger("eqrope").removeHandler(handler)` turns
    the lines off again. An application that configures the root logger itself
    (`logging.basicConfig`) does not need this: eqrope's lines reach the root's handlers
    too, so with both each line shows twice.
    """
    logger = logging.getLogger("eqrope")
    logger.setLevel(level)
    handler = next((h for h in logger.handlers if h.get_name() == _HANDLER), None)
    if handler is None:
        handler = logging.StreamHandler()
        handler.set_name(_HANDLER)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
    handler.setStream(sys.stderr if stream is None else stream)
    handler.setLevel(level)
    return handler

