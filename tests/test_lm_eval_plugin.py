"""eqrope as an lm-eval plugin: the `lm_eval.models` entry point of the installed distribution.

lm-eval's main branch (PR #4013, after 0.4.13) registers every entry point of that group as
a lazy placeholder and, when the module's own `@register_model("eqrope")` runs, swaps it for
the class only if the entry point's value is `f"{cls.__module__}:{cls.__name__}"`. The
declaration is read from the installed metadata (`pip install -e .`), without lm-eval.
"""

from importlib.metadata import entry_points

import pytest


def _eqrope_entry_point():
    found = [ep for ep in entry_points(group="lm_eval.models") if ep.name == "eqrope"]
    assert len(found) == 1, (
        f"the installed eqrope declares {len(found)} 'eqrope' entry points in the group "
        "lm_eval.models; reinstall it (pip install -e .) after editing pyproject.toml."
    )
    return found[0]


def test_declares_the_eqrope_model_to_lm_eval():
    ep = _eqrope_entry_point()
    assert ep.value == "eqrope.eval._lm:LM"
    assert ep.dist is not None and ep.dist.name == "eqrope"


def test_the_entry_point_loads_eqrope_eval_lm():
    pytest.importorskip("lm_eval")
    import eqrope.eval

    ep = _eqrope_entry_point()
    cls = ep.load()
    assert cls is eqrope.eval.LM
    # What lm-eval's registry compares to upgrade the placeholder to the decorated class.
    assert ep.value == f"{cls.__module__}:{cls.__name__}"
