"""Known keys: every config group is closed, so a typo is an error with a did-you-mean.

Hydra refuses an unknown key without `+` (with a hint to add one) and takes it with `+`, where
OmegaConf's typed conversion then drops it: `+attn.decode.blockn=16` would run as if never given.
Here a key is known when the schema dataclasses (flexgemma/config/schema.py) declare it; what lies under
a field typed `Any` or `dict` (model.hf_config, task.reward, attn.*.extra) is free-form. The top
level stays open to `+NAME=...` (a sweep axis such as `+repeat=0,1`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any, Optional, Sequence

from omegaconf import DictConfig


@functools.lru_cache(maxsize=None)
def _fields(schema: type) -> dict[str, Any]:
    """A schema's field names and their resolved types."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _is_schema(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def key_problem(path: Sequence[str], schema: type) -> Optional[str]:
    """Why the dotted key `path` is not a key of `schema` (None when it is, or when it reaches a
    free-form field). The message names the closest keys and every key of the group."""
    node = schema
    for i, part in enumerate(path):
        fields = _fields(node)
        if part not in fields:
            return _unknown(path[:i], part, fields)
        nxt = fields[part]
        if not _is_schema(nxt):
            return None  # a leaf, or a free-form value (Any, dict): nothing below it is checked
        node = nxt
    return None


def _unknown(parent: Sequence[str], part: str, fields: dict[str, Any]) -> str:
    prefix = ".".join(parent) + "." if parent else ""
    close = difflib.get_close_matches(part, list(fields), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(prefix + c for c in close)}? " if close else ""
    where = prefix.rstrip(".") or "the top level"
    return f"unknown key {prefix}{part}: {hint}({where} takes {', '.join(fields)})"


def override_problems(overrides: Sequence[str], schema: type) -> list[str]:
    """The command-line overrides whose key is not in the schema. Inside a group every key is
    checked, with or without `+`; a new top-level key needs `+` (`+repeat=0,1`), and a group
    choice (`quant=bnb4`, `hydra/launcher=basic`) is left to Hydra."""
    out = []
    top = _fields(schema)
    for o in overrides:
        key, eq, _ = o.partition("=")
        if not eq or o.startswith("-"):
            continue  # a flag (--cfg, -m, --help)
        bare = key.lstrip("+~")
        path = bare.split(".")
        if "/" in bare or path[0] == "hydra":
            continue
        if path[0] not in top and key.startswith("+"):
            continue  # a new top-level key (+repeat=0,1)
        if len(path) == 1 and _is_schema(top.get(path[0])):
            continue  # a group choice (quant=bnb4)
        problem = key_problem(path, schema)
        if problem:
            out.append(f"{o}: {problem}")
    return out


def config_problems(cfg: DictConfig, schema: type) -> list[str]:
    """Keys of a composed config's groups that the schema does not declare (added with `+`, or by
    open_dict); top-level keys are not checked (sweep axes)."""
    out: list[str] = []
    for name, tp in _fields(schema).items():
        if _is_schema(tp) and isinstance(cfg.get(name), DictConfig):
            _walk(cfg[name], tp, [name], out)
    return out


def _walk(node: DictConfig, schema: type, path: list[str], out: list[str]) -> None:
    fields = _fields(schema)
    for key in node.keys():
        key = str(key)
        if key not in fields:
            out.append(_unknown(path, key, fields))
        elif _is_schema(fields[key]) and isinstance(node.get(key), DictConfig):
            _walk(node[key], fields[key], path + [key], out)
