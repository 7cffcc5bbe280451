"""Tokenizers shipped with flexgemma, by name (a directory here holding tokenizer.json): `tiny`, the
byte-level BPE of the tiny test models (build_tiny.py makes it). `model.tokenizer` takes one of
these names or a directory of its own."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def shipped() -> list[str]:
    return sorted(p.parent.name for p in HERE.glob("*/tokenizer.json"))


def tokenizer_dir(name_or_dir: str) -> Path:
    """The directory of a shipped tokenizer's name, or the directory given; ValueError when it holds
    no tokenizer.json."""
    if name_or_dir in shipped():
        return HERE / name_or_dir
    path = Path(name_or_dir).expanduser()
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"model.tokenizer={name_or_dir}: neither a tokenizer shipped with flexgemma "
                         f"({', '.join(shipped())}) nor a directory with a tokenizer.json")
    return path
