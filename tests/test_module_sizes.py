"""The layout rule of the developers' guide: no Python module past 400 lines, in the library,
its tests, benches, experiments and docs' helpers (a long module is two concepts)."""

from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "tests", "bench", "experiments", "docs")
LIMIT = 400


def test_no_module_is_longer_than_400_lines():
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*.py")
    }
    assert len(sizes) > 250  # the folders were found
    assert {path: n for path, n in sizes.items() if n > LIMIT} == {}
