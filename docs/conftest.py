"""Every Python block in docs/*.md runs as a test; `>>>` blocks check their output."""

import doctest
import os
from pathlib import Path

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser


ROOT = Path(__file__).resolve().parent.parent


def _setup(namespace):
    namespace["_cwd"] = os.getcwd()
    os.chdir(ROOT)


def _teardown(namespace):
    os.chdir(namespace["_cwd"])


pytest_collect_file = Sybil(
    parsers=[
        PythonCodeBlockParser(
            doctest_optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        )
    ],
    patterns=["*.md"],
    setup=_setup,
    teardown=_teardown,
).pytest()
