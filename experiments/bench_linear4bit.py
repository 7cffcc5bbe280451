"""E2B's and 31B's 4-bit projection groups at decode batch sizes, alone on the GPU: bitsandbytes'
Linear4bit modules (dequantise + GEMM, one member at a time), the bf16 fused GEMM they stand in for,
`linear4bit.Linear4bitGroup` (one Triton kernel a group, `kernels.linear4bit=triton`) over a
grid of tile options, with and without an unmerged LoRA r32 inside, and the group's path past
kernels.linear4bit_max_rows (dequantised once, by bitsandbytes' op or the group's own kernel, then
one GEMM).

    python experiments/bench_linear4bit.py --batch-sizes 8,32,64 --out linear4bit.json
    python experiments/bench_linear4bit.py --groups 31b_gate_up,31b_down --batch-sizes 64,128,256 --grid-batch-sizes 0

Weights are random NF4 with double quantisation (quant=bnb4's defaults). Reported: median
microseconds a call replayed from a CUDA graph (CUDA events) and the 4-bit bytes divided by that
time (the H200 streams ~4.3 TB/s); the bf16 GEMM's bytes are four times the 4-bit ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexgemma.tasks.common import cuda_time_ms  # noqa: E402

# (input width, member output widths) of E2B's groups: a sliding layer's q/k/v, a full layer's, o
# (sliding, full), gate/up and down (plain and double-wide MLP), the per-layer-input gate / projection
E2B_GROUPS = {
    "qkv_sliding": (1536, (2048, 256, 256)),
    "qkv_full": (1536, (4096, 512, 512)),
    "o_sliding": (2048, (1536,)),
    "o_full": (4096, (1536,)),
    "gate_up": (1536, (6144, 6144)),
    "gate_up_wide": (1536, (12288, 12288)),
    "down": (6144, (1536,)),
    "down_wide": (12288, (1536,)),
    "ple_gate": (1536, (256,)),
    "ple_out": (256, (1536,)),
}
# 31B's (a sliding layer's q/k/v and o, a full layer's q/k (k = v), the MLP): the RL-batch question is
# where the kernel (each program of 64 rows decodes its weights again) loses to one dequantise
# + GEMM, whose cost does not grow with the rows
GROUPS = {**E2B_GROUPS,
          "31b_qkv_sliding": (5376, (8192, 4096, 4096)),
          "31b_qk_full": (5376, (16384, 2048)),
          "31b_o_sliding": (8192, (5376,)),
          "31b_gate_up": (5376, (21504, 21504)),
          "31b_down": (21504, (5376,))}


def time_us(fn, reps: int = 10) -> float:
    """Median microseconds of one fn() replayed from a CUDA graph of `reps` calls (as decode steps run
    it: no Python or launch overhead, which eager timing of a Triton launch would mostly measure)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (and Triton's compile) outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return cuda_time_ms(graph.replay, iters=20) * 1e3 / reps


def time_tiles(matmul, x, grid: list, rel) -> tuple[list, Optional[dict]]:
    """Each tile option of `grid` for matmul(x, tiles=...): its error (rel) and time, or the error that kept
    it from running; and the fastest."""
    configs = []
    for tiles in grid:
        c = dict(tiles)
        try:
            c["rel_err"] = rel(matmul(x, tiles=tiles))
            c["us"] = time_us(lambda: matmul(x, tiles=tiles))
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit this GPU
            c["error"] = str(exc).splitlines()[0][:120]
        configs.append(c)
    timed = [c for c in configs if "us" in c]
    return configs, (min(timed, key=lambda c: c["us"]) if timed else None)


def best_tile(label: str, best: Optional[dict]) -> str:
    """`label`, the fastest tile option's microseconds and its options; empty where none ran."""
    if not best:
        return ""
    return f"{label} {best['us']:7.1f} us {({k: v for k, v in best.items() if k not in ('us', 'rel_err')})}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="8,32,64")
    ap.add_argument("--groups", default=",".join(E2B_GROUPS), help=f"of {', '.join(GROUPS)}")
    ap.add_argument("--grid-batch-sizes", default="8,64", help="batch sizes that also time the tile grid")
    ap.add_argument("--grid-groups", default="qkv_sliding,o_sliding,gate_up_wide,down_wide",
                    help="groups that time the tile grid")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from flexgemma.config.kernels import Kernels
    from flexgemma.model.linear4bit import TILES, Linear4bitGroup
    from flexgemma.model.quant import Bnb4Settings, linear4bit_from

    # the "triton" columns time the kernel at every size (the engine takes it up to
    # kernels.linear4bit_max_rows rows only; the dequant columns time its path beyond)
    every_size = Kernels(linear4bit_max_rows=max(512, *[int(b) for b in args.batch_sizes.split(",")]))

    dev, dt = torch.device("cuda"), torch.bfloat16
    s = Bnb4Settings("nf4", True, 64, dt)
    # (BLOCK_N, BLOCK_K, num_warps): one K step a program, so K / BLOCK_K programs per feature tile
    grid = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=3)
            for bn, bk, w in ((32, 256, 4), (64, 256, 4), (128, 256, 8), (64, 512, 8), (64, 128, 4), (128, 128, 4))]
    # several K steps a program (fewer float32 partials: at 64 rows 31B's gate/up writes 231 MB of them)
    grid += [dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3, K_STEPS=ks) for ks in (2, 4)]
    grid += [dict(BLOCK_N=128, BLOCK_K=256, num_warps=8, num_stages=3, K_STEPS=ks) for ks in (2, 4)]
    # and both: 128 rows a program over several K steps (each weight decoded once per 128 rows, a
    # quarter or an eighth of the partials)
    grid += [dict(ROW_TILE=128, BLOCK_N=64, BLOCK_K=256, num_warps=8, num_stages=2, K_STEPS=4),
             dict(ROW_TILE=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=2, K_STEPS=8)]
    # past 64 rows: programs of more rows (each decodes its weights once for all of them)
    grid += [dict(ROW_TILE=rt, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s_)
             for rt, bn, bk, w, s_ in ((128, 64, 128, 8, 3), (128, 64, 256, 8, 2), (128, 128, 128, 8, 2),
                                       (256, 64, 64, 8, 2), (256, 128, 64, 8, 2))]
    grid_sizes = {int(b) for b in args.grid_batch_sizes.split(",")}
    grid_groups = set(args.grid_groups.split(","))
    res: dict = {"default": TILES, "runs": []}
    torch.manual_seed(0)
    totals: dict = {}
    for name in args.groups.split(","):
        k, outs = GROUPS[name]
        lin = [torch.nn.Linear(k, n, bias=False, device=dev, dtype=dt) for n in outs]
        dense = torch.cat([m.weight.detach() for m in lin])
        mods = [linear4bit_from(m, s, dev) for m in lin]
        del lin
        group = Linear4bitGroup(mods, every_size)
        nbytes = group.packed.numel()
        r = args.rank * len(outs)
        a = torch.randn(r, k, device=dev, dtype=dt) * 0.01
        b = torch.randn(sum(outs), r, device=dev, dtype=dt) * 0.01
        def bnb_lora():  # bitsandbytes' modules, the adapter as LowRankGroup runs it beside them
            xa, out, r0, o0 = F.linear(x, a), [], 0, 0
            for m in mods:
                out.append(torch.addmm(m(x), xa[:, r0: r0 + args.rank], b[o0: o0 + m.out_features, r0: r0 + args.rank].t()))
                r0, o0 = r0 + args.rank, o0 + m.out_features
            return out

        for bs in [int(x) for x in args.batch_sizes.split(",")]:
            x = torch.randn(bs, k, device=dev, dtype=dt)
            ref = torch.cat([m(x) for m in mods], -1).float()
            rel = lambda y: ((y.float() - ref).norm() / ref.norm()).item()  # noqa: E731
            row = {"group": name, "batch": bs, "in": k, "outs": list(outs), "bytes_4bit": nbytes,
                   "bnb_us": time_us(lambda: [m(x) for m in mods]),
                   "bnb_lora_us": time_us(bnb_lora),
                   "bf16_us": time_us(lambda: F.linear(x, dense)),
                   "triton_us": time_us(lambda: group.matmul(x)),
                   # the engine's path past kernels.linear4bit_max_rows: the group dequantised once, one GEMM
                   "dequant_gemm_us": time_us(lambda: F.linear(x, group.dequantize_bnb())),
                   "dequant_triton_gemm_us": time_us(lambda: F.linear(x, group.dequantize_triton())),
                   "dequant_us": time_us(group.dequantize_triton),  # the group's kernel alone
                   "dequant_bnb_us": time_us(group.dequantize_bnb),  # bitsandbytes' op (+ torch's scale decode)
                   "triton_lora_us": time_us(lambda: group.matmul(x, F.linear(x, a), b)),
                   "rel_err": rel(group.matmul(x))}
            small = [c for c in grid if bs in grid_sizes and name in grid_groups
                     and c.get("ROW_TILE", TILES["ROW_TILE"]) <= max(64, bs)]
            row["configs"], row["best"] = time_tiles(group.matmul, x, small, rel)
            res["runs"].append(row)
            for key in ("bnb_us", "bnb_lora_us", "bf16_us", "triton_us", "dequant_gemm_us", "dequant_triton_gemm_us",
                        "dequant_us", "dequant_bnb_us", "triton_lora_us"):
                totals.setdefault(bs, {}).setdefault(key, 0.0)
                totals[bs][key] += row[key]
            best = row["best"]
            print(f"{name:13s} bs {bs:3d} {nbytes / 1e6:6.1f} MB: bnb {row['bnb_us']:7.1f} us, bf16 {row['bf16_us']:7.1f} "
                  f"us, dequant+gemm {row['dequant_gemm_us']:7.1f} us (with the triton dequant "
                  f"{row['dequant_triton_gemm_us']:7.1f}; dequant alone {row['dequant_bnb_us']:6.1f} vs "
                  f"{row['dequant_us']:6.1f}), triton {row['triton_us']:7.1f} us "
                  f"({nbytes / row['triton_us'] / 1e6:.2f} TB/s), +lora "
                  f"{row['triton_lora_us']:7.1f} us (bnb+lora {row['bnb_lora_us']:7.1f}), rel err {row['rel_err']:.1e}"
                  + best_tile("; best", best), flush=True)
    res["totals_us"] = totals
    for bs, t in totals.items():
        print(f"sum over the groups, bs {bs}: " + ", ".join(f"{k_} {v:8.1f}" for k_, v in t.items()))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
