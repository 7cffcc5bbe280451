"""Reading a checkpoint's or adapter's files with errors that name the file and what is wrong.

json.loads and safetensors raise bare JSONDecodeError / SafetensorError that name no file; a user
with a directory of several files then cannot tell which one is broken.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(path: Path, error: type[Exception]) -> dict[str, Any]:
    """The JSON object in `path`; `error` (a ValueError subclass) naming the file when it is not one."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg} "
                    "(a truncated download or a hand edit? fix or re-download the file)") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object ({{...}}), found a {type(data).__name__}")
    return data


def open_safetensors(path: Path, error: type[Exception]):
    """A safetensors handle (safe_open, CPU); `error` naming the file when it is truncated or not one."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise error(f"{path}: not a readable safetensors file ({e}): truncated or corrupt? re-download or "
                    "re-save it") from None


def get_tensor(handle, path: Path, key: str, error: type[Exception]):
    """One tensor of an open safetensors file; `error` naming the file and key when it cannot be read."""
    from safetensors import SafetensorError

    try:
        return handle.get_tensor(key)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise error(f"{path}: tensor {key} cannot be read ({e}): truncated or corrupt file?") from None
