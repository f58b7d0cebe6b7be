"""What the wheel holds, and that the API reference lists every public name."""

import re
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

import eqrope
import eqrope.testing


ROOT = Path(__file__).resolve().parent.parent
# Build outputs and caches of the checkout that must not reach the copy the wheel is built from.
_NOT_SOURCE = (
    ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build the wheel from a copy of the checkout (setuptools writes `build/` in the tree
    it builds), without build isolation or an index, so nothing is downloaded.

    Returns the wheel's file names, its METADATA and the build's output.
    """
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    # -v shows the build backend's output, where setuptools prints its deprecations.
    command = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation"]
    command += ["--no-index", "--disable-pip-version-check", "-w", str(tmp / "out"), str(source)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    (path,) = (tmp / "out").glob("eqrope-*.whl")
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        return names, archive.read(metadata).decode(), output


@pytest.mark.packaging
def test_wheel_holds_the_package_typed_and_licensed(wheel):
    names, _, _ = wheel
    modules = {f"eqrope/{p.name}" for p in (ROOT / "src" / "eqrope").glob("*.py")}
    assert modules <= set(names)
    assert "eqrope/py.typed" in names
    (dist_info,) = {name.split("/")[0] for name in names if ".dist-info/" in name}
    assert f"{dist_info}/licenses/LICENSE" in names


@pytest.mark.packaging
def test_wheel_holds_nothing_else(wheel):
    names, _, _ = wheel
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"eqrope"}
    outside = r"tests?/|experiments/|bench/|docs/|checkpoints|\.safetensors$"
    stray = [name for name in names if re.search(outside, name)]
    assert stray == []


@pytest.mark.packaging
def test_wheel_metadata_has_the_spdx_license(wheel):
    _, metadata, _ = wheel
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()


@pytest.mark.packaging
def test_build_prints_no_warnings(wheel):
    _, _, output = wheel
    # distutils' "byte-compiling is disabled" notes follow PYTHONDONTWRITEBYTECODE, not the project.
    lines = [line for line in output.splitlines() if "byte-compiling is disabled" not in line]
    warnings = [line for line in lines if re.search(r"(?i)warning|deprecat", line)]
    assert warnings == [], "\n".join(warnings)


def _documented() -> set[str]:
    """The identifiers of the `::: identifier` lines of the API pages."""
    pages = (ROOT / "docs" / "api").glob("*.md")
    return {m for page in pages for m in re.findall(r"^::: (\S+)$", page.read_text(), re.M)}


def _public(module: types.ModuleType, home: str) -> set[str]:
    """The public names of `module` for objects defined in modules named `home...`."""
    found = set()
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        if (getattr(value, "__module__", None) or "").startswith(home):
            found.add(f"{module.__name__}.{name}")
    return found


def test_api_reference_lists_every_public_name():
    documented = _documented()
    public = _public(eqrope, "eqrope.")
    if "eqrope.testing" not in documented:  # a module's page documents its public members
        public |= _public(eqrope.testing, "eqrope.testing")
    missing = sorted(public - documented)
    assert missing == [], f"add a `::: NAME` line to a page of docs/api/ for each of {missing}"
