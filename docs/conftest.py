"""Every Python block in docs/*.md runs as a test; `>>>` blocks check their output.

Each page runs in a fresh temporary working directory, as a reader's copy of it would run
anywhere: a block that reads a file of the checkout by a relative path fails, and what a
block writes by a relative path lands in that directory, not in the checkout. The pages
in `FROM_CHECKOUT` still run from the checkout's root until they are fixed.

Blocks that need an optional extra sit between `<!-- skip: start if(_missing("lm_eval"),
reason="...") -->` and `<!-- skip: end -->` (Sybil's skip directive): skipped without it.
"""

import doctest
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser


ROOT = Path(__file__).resolve().parent.parent
# Pages that still read files of the checkout by a relative path, with why.
FROM_CHECKOUT: dict[str, str] = {}


def _missing(module: str) -> bool:
    """Whether `module` is not installed (the condition of a page's skip directive)."""
    return importlib.util.find_spec(module) is None


def _elsewhere(namespace):
    namespace["_missing"] = _missing
    namespace["_cwd"] = os.getcwd()
    namespace["_folder"] = tempfile.mkdtemp(prefix="eqrope_docs_")
    os.chdir(namespace["_folder"])


def _at_root(namespace):
    namespace["_missing"] = _missing
    namespace["_cwd"] = os.getcwd()
    os.chdir(ROOT)


def _teardown(namespace):
    os.chdir(namespace["_cwd"])
    if "_folder" in namespace:
        shutil.rmtree(namespace["_folder"], ignore_errors=True)


def _sybil(setup, **files) -> Sybil:
    return Sybil(
        parsers=[
            PythonCodeBlockParser(
                doctest_optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
            ),
            SkipParser(),
        ],
        setup=setup,
        teardown=_teardown,
        **files,
    )


pytest_collect_file = (
    _sybil(_elsewhere, patterns=["*.md"], excludes=list(FROM_CHECKOUT))
    + _sybil(_at_root, patterns=list(FROM_CHECKOUT))
).pytest()
