"""The public types as an editor sees them: mypy on tests/data/types_check.py.

That file holds `typing.assert_type` lines for what `generate`, `generate_text`,
`make_train_step` and `make_adapter_train_step` return; mypy reads eqrope's annotations
through its `py.typed` (`--follow-imports=silent`: the library is analysed for its types,
and only the small file's errors are reported, so jaxtyping's annotations inside eqrope do
not count).
"""

import pathlib
import subprocess
import sys


CHECKS = pathlib.Path(__file__).parent / "data" / "types_check.py"


def test_public_types_pass_mypy(tmp_path):
    # mypy comes with the [dev] extra, so this never skips.
    proc = subprocess.run(
        # optax ships no py.typed: its names are Any, which the checks allow for.
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-incremental",
         "--disable-error-code=import-untyped",
         "--python-version", "3.11", "--cache-dir", str(tmp_path / "cache"), str(CHECKS)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found in 1 source file" in proc.stdout
