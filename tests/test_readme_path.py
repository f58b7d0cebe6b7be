"""Issue 38: the README's two commands work in the README's own venv, and CI walks them.

- The main job imports no optional extra: `bench/kv_cache.py` runs up to its argument
  parsing (every module it imports, imported) in a subprocess where the extras' modules
  cannot be imported, and the same harness does fail on a module that imports torch.
- `.ci/run` runs the README's commands as a newcomer does: `[dev]` alone, then the main
  job, before any extra is installed; the suite after.
- The README's benchmark block is the bench's own table of the committed run's JSON.
"""

import json
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from _bench import BENCH, ROOT, load


README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()

# Imports `script` with the modules of the optional extras refused, as in a venv that has
# only `[dev]`, then runs it as `python script args...`.
WITHOUT_EXTRAS = """
import importlib.abc, pathlib, runpy, sys

blocked, script, *args = sys.argv[1:]
blocked = set(blocked.split(","))


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (an optional extra)", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
sys.argv = [script, *args]
sys.path.insert(0, str(pathlib.Path(script).parent))
runpy.run_path(script, run_name="__main__")
"""


def extras_modules() -> list[str]:
    """The top-level modules of the packages of the `[hf]`, `[eval]` and `[serve]` extras, read from
    pyproject.toml (a distribution's name, dashes as underscores: lm-eval is lm_eval)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [
        re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]
        for extra in ("hf", "eval", "serve")
        for requirement in project["optional-dependencies"][extra]
    ]
    return sorted({name.replace("-", "_").lower() for name in names})


def run_without_extras(script: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRAS, ",".join(extras_modules()), str(script), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_extras_modules_are_the_ones_a_dev_venv_lacks():
    assert {"torch", "transformers", "lm_eval", "peft", "accelerate"} <= set(extras_modules())


def test_the_main_job_imports_no_optional_extra():
    done = run_without_extras(BENCH / "kv_cache.py", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: kv_cache.py" in done.stdout


def test_the_check_fails_on_a_module_that_imports_torch():
    # The same harness on the module that needs the [hf] extra: it must fail, naming torch,
    # or the test above could not fail either.
    done = run_without_extras(BENCH / "_real_shapes.py")
    assert done.returncode != 0
    assert "No module named 'torch' (an optional extra)" in done.stderr


def lines_of(script: str) -> list[str]:
    """The commands of a shell script: no comments, no blank lines."""
    return [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def first_index(lines: list[str], pattern: str) -> int:
    matches = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    assert matches, f".ci/run has no line matching {pattern!r}"
    return matches[0]


def test_ci_runs_the_readme_commands_in_a_newcomers_order():
    first, second = [
        line for line in README.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
        if line.strip() and not line.startswith("#")
    ][:2]
    install, main_job = first.split(" && ")
    assert (install, main_job) == ('pip install -e ".[dev]"', "python bench/kv_cache.py")
    assert second == f"{install} && pytest"
    ci = lines_of(CI)
    venv = first_index(ci, r"^python3 -m venv \.venv$")
    activate = first_index(ci, r"^source \.venv/bin/activate$")
    dev = first_index(ci, "^" + re.escape(install) + "$")
    # The main job, in its tiny mode (every section, tiny sizes), with [dev] alone.
    job = first_index(ci, re.escape(main_job) + r" --tiny( |$)")
    collect = first_index(ci, r"^pytest --collect-only")
    extras = first_index(ci, r"^pip install (torch|.*\[hf|.*\[eval)")
    suite = ci.index("pytest")
    assert venv < activate < dev < job < extras
    assert dev < collect < extras < suite


def benchmark_block() -> str:
    section = README.split("## Latest benchmark", 1)[1]
    return section.split("```\n", 1)[1].split("```", 1)[0]


def test_readme_benchmark_block_is_the_bench_table_of_the_committed_run():
    sys.path.insert(0, str(BENCH))
    try:
        import _report
    finally:
        sys.path.remove(str(BENCH))
    result = json.loads((BENCH / "results" / "kv_cache_cpu.json").read_text())
    assert benchmark_block().rstrip("\n") == _report.table(result)
    # The prose beside it states the run's own date and wall time.
    section = README.split("## Latest benchmark", 1)[1].split("```", 1)[0]
    assert result["machine"]["date"][:10] in section
    assert f"{result['wall_s']:.0f} s" in section


@pytest.mark.parametrize("figure", ["test_time", "skips"])
def test_readme_test_figures_are_the_measured_ones(figure):
    measured = json.loads((ROOT / "tests" / "data" / "suite_figures.json").read_text())
    tests = " ".join(README.split("## Tests", 1)[1].split())
    if figure == "skips":
        assert f"{measured['skipped_without_extras']} tests skip" in tests
    else:
        minutes = measured["tests_s"] / 60
        stated = re.search(r"about (\d+)[–-](\d+) minutes on 2 cores", tests)
        assert stated and int(stated[1]) <= minutes <= int(stated[2]) + 1, (stated, minutes)
        assert f"the tests {measured['tests_s']} s" in tests


def test_readme_first_call_table_is_the_committed_run():
    """The README's first-call table is bench/first_call.py's table of its committed JSON,
    with the run's date and load averages beside it."""
    sys.path.insert(0, str(BENCH))  # first_call.py imports its bench/ neighbours
    try:
        first_call = load("first_call")
    finally:
        sys.path.remove(str(BENCH))
    result = json.loads((BENCH / "results" / "first_call_cpu.json").read_text())
    section = README.split("### First calls", 1)[1].split("\n## ", 1)[0]
    assert first_call.readme_table(result) in section
    assert result["machine"]["date"][:10] in section
    start, end = result["loadavg"]["start"][0], result["loadavg"]["end"][0]
    assert f"{start:.1f}" in section and f"{end:.1f}" in section
