"""The JSON files of a model directory: an eqrope checkpoint's or a Hugging Face model's.

Every field read from one goes through a check that names it by its key in the file
(`checked`), so an error says which line of which file to fix.
"""

import json
from pathlib import Path


def read_json(file: Path, who: str, fix: str = "") -> dict:
    """The JSON object in `file`, which the caller has checked exists.

    A file that is not JSON, or holds something other than an object, raises `ValueError`
    with a message that starts with `who` (the public function reading it), names `file`,
    and ends with `fix` (what to do about it), if given.
    """
    fix = f" {fix}" if fix else ""
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{who}: {file} is not valid JSON ({e}).{fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{who}: {file} must hold a JSON object, got {type(data).__name__}.{fix}")
    return data


def peek_json(file: Path) -> dict:
    """The JSON object in `file`, or `{}` if it is missing, damaged or not an object.

    For asking whose file it is (say, its `"format"`) before overwriting it.
    """
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def checked(check, value, key: str, where: str, **kwargs):
    """`check(value, key, **kwargs)` for the field `key` of a JSON file.

    `check` is one of the argument checks (`check_int`, `check_float`, ...), which raise a
    `TypeError` or `ValueError` naming `key`; either is raised again as a `ValueError`
    that starts with `where` (the public function and the file: `"from_hf: .../config.json"`),
    since the fix is to the file, not to an argument.
    """
    try:
        return check(value, key, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
