"""A 4-bit code table looked up in registers (PTX `prmt`) instead of by a load per weight: a candidate for the
fused 4-bit expert kernels, which Nsight Compute found bound by their instructions per weight, the table's
gathers and their address arithmetic the most (experiments/RESULTS.md, 2026-12-06 (b)).

`lookup_asm(code)` is the inline PTX for `tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r", [bytes],
dtype=(dt, dt), is_pure=True, pack=4)`: four packed bytes in, the code values of their high nibbles (two
registers of two 16-bit values, byte i -> element i) and of their low nibbles (two more) out. The 16-entry
table of 16-bit values is split into its low and high bytes, eight entries to a register pair, so that one
`prmt` looks up four nibbles' bytes among eight entries; a nibble's bit 3 picks the half (a byte mask made by
`prmt`'s sign mode, then `lop3`), and `prmt`s interleave low and high bytes into 16-bit values: 26
instructions for eight weights (the gather path: about 6 a weight, Nsight Compute's count).

`run(asm, word)` executes that PTX subset on the CPU, so that a test checks the assembly itself (every byte
value, nf4 and fp4, bf16 and fp16 tables) where Triton's interpreter cannot run inline assembly.
"""

from __future__ import annotations

import re

import torch

# one 32-bit word of four bytes is eight nibbles in order (byte i: low nibble = nibble 2i, the byte's second
# weight; high nibble = nibble 2i+1, its first), and prmt reads four nibbles of a selector's low 16 bits, so
# each half of the word is one selector with no shuffling: bytes 0-1 (half A), then 2-3 (half B)
_ASM = """mov.b32 k80, 0x80;
mov.b32 z, 0;
{tables}
and.b32 sa, $4, 0x77777777;
shr.b32 sb, sa, 16;
shr.b32 m, $4, 3;
and.b32 m, m, 0x11111111;
xor.b32 c, m, 0x11111111;
shl.b32 m, m, 3;
or.b32 m, m, c;
prmt.b32 ma, k80, z, m;
shr.b32 m, m, 16;
prmt.b32 mb, k80, z, m;
prmt.b32 la, lo0, lo1, sa;
prmt.b32 c, lo2, lo3, sa;
lop3.b32 la, la, c, ma, 0xD8;
prmt.b32 ha, hi0, hi1, sa;
prmt.b32 c, hi2, hi3, sa;
lop3.b32 ha, ha, c, ma, 0xD8;
prmt.b32 lb, lo0, lo1, sb;
prmt.b32 c, lo2, lo3, sb;
lop3.b32 lb, lb, c, mb, 0xD8;
prmt.b32 hb, hi0, hi1, sb;
prmt.b32 c, hi2, hi3, sb;
lop3.b32 hb, hb, c, mb, 0xD8;
prmt.b32 $0, la, ha, 0x7351;
prmt.b32 $1, lb, hb, 0x7351;
prmt.b32 $2, la, ha, 0x6240;
prmt.b32 $3, lb, hb, 0x6240;"""


def table_words(code: torch.Tensor) -> list[int]:
    """The 16 entries' 16-bit patterns as eight words: low bytes of entries 0-3, 4-7, 8-11, 12-15, then the
    high bytes the same way (byte j of a word: entry 4 * word + j)."""
    bits = [int(v) & 0xFFFF for v in code.cpu().view(torch.int16).tolist()]
    if len(bits) != 16:
        raise ValueError(f"a 4-bit code table has 16 entries, got {len(bits)}")
    words = []
    for shift in (0, 8):
        for w in range(4):
            words.append(sum(((bits[4 * w + j] >> shift) & 0xFF) << (8 * j) for j in range(4)))
    return words


def lookup_asm(code: torch.Tensor) -> str:
    """The PTX described above for a table of 16-bit values (`code`, in the rows' dtype): per word, the
    selectors (each nibble's low 3 bits), a byte mask a half (0xFF where the nibble's bit 3 is set: the
    sign of byte 0x80 replicated, else byte 0x00), four lookups a half (low and high bytes from entries
    0-7 and 8-15) merged by the mask (lop3: mask ? upper : lower), and the bytes interleaved into 16-bit
    values (high nibbles' to $0 $1, low nibbles' to $2 $3): 26 instructions for eight weights beside the
    table's constants."""
    names = ["lo0", "lo1", "lo2", "lo3", "hi0", "hi1", "hi2", "hi3"]
    tables = "\n".join(f"mov.b32 {n}, 0x{w:08X};" for n, w in zip(names, table_words(code)))
    regs = ".reg .b32 k80, z, sa, sb, m, c, ma, mb, la, lb, ha, hb, " + ", ".join(names) + ";"
    return "{\n" + regs + "\n" + _ASM.format(tables=tables) + "\n}"


# -- the PTX subset above, executed on 32-bit integers --------------------------------------------------
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
        bs = [4 * w + j for j in range(4)]
        out = run(asm, sum(b << (8 * j) for j, b in enumerate(bs)))
        for j, b in enumerate(bs):
            hi = (out[j // 2] >> (16 * (j % 2))) & 0xFFFF
            lo = (out[2 + j // 2] >> (16 * (j % 2))) & 0xFFFF
            if (hi, lo) != (bits[b >> 4], bits[b & 15]):
                raise AssertionError(f"byte {b:#04x}: got {hi:#06x}, {lo:#06x}; want {bits[b >> 4]:#06x}, "
                                     f"{bits[b & 15]:#06x}")
