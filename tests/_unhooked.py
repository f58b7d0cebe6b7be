"""Calls run once without the jaxtyping hook, as a user runs them.

Under pytest the hook (`--jaxtyping-packages=eqrope,...`) checks annotations before a
function body runs, so a wrongly typed argument raises jaxtyping's `TypeCheckError`
before eqrope's own check. The messages a user sees come from a fresh interpreter.
"""

import json
import pathlib
import subprocess
import sys
import textwrap


_LOOP = """
out = {}
for name, case in cases.items():
    try:
        case()
        out[name] = "no error"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def messages_without_the_hook(setup: str) -> dict[str, str]:
    """Run `setup` (Python that defines a dict `cases` of name -> call with no argument)
    in a fresh interpreter without the hook, the tests' helpers importable (`_models`).
    **Returns:** each case's `"TypeName: message"`, or `"no error"`."""
    here = str(pathlib.Path(__file__).parent)
    code = f"import json, sys\nsys.path.insert(0, {here!r})\n" + textwrap.dedent(setup) + _LOOP
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])
