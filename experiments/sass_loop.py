"""The machine code of the fused 4-bit up kernel's hot loop, compiled for an H100/H200 (sm_90) on a machine
without a GPU: Triton's own ptxas and cuobjdump turn the kernel, specialised exactly as a launch would
specialise it, into SASS, and this counts the instructions of each loop that issues tensor-core MMAs.

Nsight Compute found the kernel bound by its instructions per weight (experiments/RESULTS.md, 2026-12-06 (b)),
so a variant's count per loop step is a first filter before a GPU call: for kernels.moe_code_lookup and
kernels.moe_4bit_prefetch, each loop's length, instructions per weight and the classes that fill it.

    python experiments/sass_loop.py                       (table / select / prmt, with and without prefetch)
    python experiments/sass_loop.py --dump prmt_pf        (that variant's whole SASS to stdout)

The local Triton may be newer than the GPU machine's: counts are indicative, the GPU's timing decides.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_4bit_forms import routing, up_dot  # noqa: E402
from flexgemma.model.moe_kernel import UP_TILES, _routed_up_kernel  # noqa: E402

VARIANTS = {"table": ("table", False), "table_pf": ("table", True), "select_pf": ("select", True),
            "prmt": ("prmt", False), "prmt_pf": ("prmt", True)}
# SASS opcode (before the first dot) -> what it does in this kernel
CLASSES = {"HMMA": "mma", "LDG": "global load", "LDS": "shared", "STS": "shared", "LDSM": "shared",
           "PRMT": "byte permute", "LOP3": "logic", "SHF": "shift", "LEA": "address", "IADD3": "integer",
           "IMAD": "integer", "FFMA": "float", "FMUL": "float", "FADD": "float", "F2FP": "convert",
           "BAR": "barrier", "BRA": "branch", "ISETP": "compare", "SEL": "select", "MOV": "move", "I2F": "convert",
           "F2I": "convert", "LDC": "constant", "ULDC": "constant"}


def compile_sass(kernel, launch, arch: int = 90) -> str:
    """SASS of `kernel` as `launch()` launches it, for sm_`arch`: the launch's arguments bound and
    specialised (divisibility, constexprs) by Triton's own binder, compiled with its ptxas, disassembled by
    its cuobjdump; `launch` runs on CPU tensors and the kernel never runs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    seen = {}
    kernel.run = lambda *a, grid, warmup, **kw: seen.update(args=a, kwargs=kw)
    try:
        launch()
    finally:
        del kernel.run
    if not seen:
        raise RuntimeError(f"launch() never launched {kernel.fn.__name__}")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*seen["args"], **seen["kwargs"])
    options, signature, constexprs, attrs = kernel._pack_args(backend, seen["kwargs"], bound, spec, options)
    compiled = compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    cuobjdump = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True).stdout


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction."""
    return [(int(m.group(1), 16), m.group(3), m.group(4)) for m in _LINE.finditer(sass)]


def mma_loops(sass: str) -> list[list[tuple[int, str, str]]]:
    """The innermost backward-branch ranges that contain an HMMA: each loop's instructions, in order."""
    ins = instructions(sass)
    loops = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            body = [i for i in ins if int(target.group(1), 16) <= i[0] <= addr]
            if any(i[1].startswith("HMMA") for i in body):
                loops.append(body)
    # innermost first: a loop that contains another's range is an outer loop
    return [b for b in loops if not any(o is not b and b[0][0] <= o[0][0] and o[-1][0] <= b[-1][0] for o in loops)]


def loop_profile(body, weights_per_step: int) -> dict:
    """A loop's length, its instructions per weight (one step decodes `weights_per_step` weights a thread)
    and its opcode classes."""
    classes = collections.Counter(CLASSES.get(op.split(".")[0], "other") for _, op, _ in body)
    return {"instructions": len(body), "per_weight": len(body) / weights_per_step, "hmma": classes["mma"],
            "classes": dict(classes.most_common())}


def up_launch(lookup: str, prefetch: bool, rows: int = 32, h: int = 2816, i: int = 704, e: int = 128, k: int = 8):
    """A decode step's up-kernel launch (26B-A4B's shapes, bf16 rows, nf4 with double quantisation) on CPU
    tensors: what bench_4bit_forms times on the GPU."""
    from flexgemma.model.quant import Bnb4Settings, PackedExpertWeight

    cpu = torch.device("cpu")
    gate_up = PackedExpertWeight.pack(torch.randn(e, 2 * i, h).bfloat16() * 0.02, Bnb4Settings(double_quant=True), cpu)
    x = torch.randn(rows, h).bfloat16()
    index, order, starts = routing(rows, e, k, cpu)
    tiles = {**UP_TILES, "BLOCK_M": 16, "PREFETCH": prefetch}
    return lambda: up_dot(x, gate_up, index, order, starts, i, k, tiles, lookup), gate_up.block_size, tiles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--dump", default=None, help="print this variant's whole SASS instead")
    args = ap.parse_args()
    for name in ([args.dump] if args.dump else args.variants.split(",")):
        lookup, prefetch = VARIANTS[name]
        launch, qblock, tiles = up_launch(lookup, prefetch)
        sass = compile_sass(_routed_up_kernel, launch)
        if args.dump:
            print(sass)
            return
        # one step: a quantisation block of gate and of up, BLOCK_N rows each, over the program's threads
        per_step = 2 * tiles["BLOCK_N"] * qblock // (32 * tiles["num_warps"])
        for n, body in enumerate(mma_loops(sass)):
            p = loop_profile(body, per_step)
            top = ", ".join(f"{c} {v}" for c, v in list(p["classes"].items())[:8])
            print(f"{name:10s} loop {n}: {p['instructions']} instructions, {p['per_weight']:.1f} a weight "
                  f"({per_step} weights a thread a step), {p['hmma']} HMMA; {top}", flush=True)


if __name__ == "__main__":
    main()
