"""Scoring and evaluation: `score` (each token's log-probability: ragged rows, shared prefixes,
rolling windows) and `LM`, eqrope as a model of lm-evaluation-harness (`pip install eqrope[eval]`).
"""

from ._score import Scores as Scores, score as score


def __getattr__(name: str):
    # `LM` subclasses lm-eval's model class, so it is defined only when lm-eval is there.
    if name == "LM":
        try:
            from ._lm import LM
        except ImportError as e:
            if e.name is None or not e.name.split(".")[0] == "lm_eval":
                raise
            raise ImportError(
                "eqrope.eval.LM is a model of EleutherAI's lm-evaluation-harness, which is not "
                "installed; install it with `pip install eqrope[eval]` (lm-eval>=0.4.8)."
            ) from e
        return LM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
