"""The PTX subset of flexgemma/model/ptx_lookup.py executed on 32-bit integers, so that a CPU test checks the
assembly itself (Triton's interpreter cannot run inline PTX)."""

from __future__ import annotations

import re

import torch

from flexgemma.model.ptx_lookup import lookup_asm


def _prmt(a: int, b: int, c: int) -> int:
    """prmt.b32 (default mode): byte i of the result is byte (c's nibble i & 7) of {b, a}, or with the
    nibble's bit 3 that byte's sign bit replicated."""
    pool = (b << 32) | a
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (pool >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for i in range(32):
        idx = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
        out |= ((lut >> idx) & 1) << i
    return out


_OPS = {
    "mov.b32": lambda a: a, "shr.b32": lambda a, b: a >> b, "shl.b32": lambda a, b: a << b,
    "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b, "xor.b32": lambda a, b: a ^ b,
    "prmt.b32": _prmt, "lop3.b32": _lop3,
}


def run(asm: str, word: int) -> list[int]:
    """Execute `asm` (the subset lookup_asm writes) with $4 = word; returns $0 .. $3."""
    regs = {"$4": word & 0xFFFFFFFF}

    def value(tok: str) -> int:
        tok = tok.strip()
        if re.fullmatch(r"0x[0-9A-Fa-f]+|\d+", tok):
            return int(tok, 0)
        return regs[tok]

    for line in asm.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *srcs = [t.strip() for t in rest.split(",")]
        if op not in _OPS:
            raise ValueError(f"not in the emulated subset: {op}")
        regs[dst] = _OPS[op](*(value(s) for s in srcs)) & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(4)]


def check(code: torch.Tensor, asm: str | None = None) -> None:
    """Every byte value through `asm` (default lookup_asm(code)), four bytes a word as Triton packs them:
    the high nibbles' entries in $0 ($1) and the low nibbles' in $2 ($3), element i in the 16 bits at
    16 * (i % 2); an AssertionError names the first byte that comes out wrong."""
    bits = [int(v) & 0xFFFF for v in code.cpu().view(torch.int16).tolist()]
    asm = lookup_asm(code) if asm is None else asm
    for w in range(64):
        bs = [(4 * w + 0x41 * j) % 256 for j in range(4)]  # every byte once; a word's four differ in both nibbles
        out = run(asm, sum(b << (8 * j) for j, b in enumerate(bs)))
        for j, b in enumerate(bs):
            hi = (out[j // 2] >> (16 * (j % 2))) & 0xFFFF
            lo = (out[2 + j // 2] >> (16 * (j % 2))) & 0xFFFF
            if (hi, lo) != (bits[b >> 4], bits[b & 15]):
                raise AssertionError(f"byte {b:#04x}: got {hi:#06x}, {lo:#06x}; want {bits[b >> 4]:#06x}, "
                                     f"{bits[b & 15]:#06x}")
