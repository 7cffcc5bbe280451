"""The 4-bit code table held in registers and looked up by PTX `prmt` (kernels.moe_code_lookup=prmt): the
fused 4-bit expert kernels (moe_kernel.py) are bound by their instructions per weight (Nsight Compute, H100),
and the table's gathers with their address arithmetic were the largest part.

`lookup_asm(code)` is the inline PTX for `tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r", [bytes],
dtype=(dt, dt), is_pure=True, pack=4)` (triton4bit.nibble_codes): four packed bytes in, the code values of
their high nibbles (two registers of two 16-bit values, byte i -> element i) and of their low nibbles (two
more) out. The 16-entry table of 16-bit values is split into its low and high bytes, eight entries to a
register pair, so that one `prmt` looks up four nibbles' bytes among eight entries; a nibble's bit 3 picks
the half (a byte mask made by `prmt`'s sign mode, then `lop3`), and `prmt`s interleave low and high bytes
into 16-bit values: 26 instructions for eight weights, the table's own entries bit for bit (the table path's
values). tests/model/ptx_emulator.py executes this PTX on the CPU for every byte value, where Triton's
interpreter cannot run inline assembly.
"""

from __future__ import annotations

import functools

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


@functools.lru_cache(maxsize=None)
def code_lookup_asm(quant_type: str, dtype: torch.dtype) -> str:
    """lookup_asm of bitsandbytes' table of `quant_type` (nf4, fp4) in `dtype`, built once (host side: a
    kernel launch never reads the table back from the GPU)."""
    from flexgemma.model.triton4bit import code4

    return lookup_asm(code4(quant_type, torch.device("cpu"), dtype))


def check_lookup_device(choice: str, device: torch.device) -> None:
    """kernels.moe_code_lookup=prmt refused where its PTX cannot run (a kernel called with a hand-built
    Kernels; config.resolve refuses it for a run)."""
    if choice == "prmt" and (device.type != "cuda" or torch.version.hip):
        raise ValueError("kernels.moe_code_lookup=prmt runs inline PTX, an NVIDIA GPU's only; on "
                         f"{device.type} use table or select (the same values)")


def lookup_constexpr(choice: str, quant_type: str, dtype: torch.dtype) -> str:
    """The LOOKUP a fused 4-bit kernel compiles with for kernels.moe_code_lookup=`choice`: prmt's PTX for
    this table, or the choice's name (a hand-built Kernels' auto reads the table: config.resolve decides
    auto for a device)."""
    if choice == "prmt":
        return code_lookup_asm(quant_type, dtype)
    return "table" if choice == "auto" else choice
