"""The routed experts' two GEMMs of one 26B-A4B layer at decode batch sizes, alone on the GPU:
torch's grouped GEMM against the Triton kernel over a grid of tile options.

    python experiments/bench_moe_kernel.py --batch-sizes 8,32,64 --out moe_kernel.json

Weights are random bf16 in the model's layout ([E, 2I, H] gate_up, [E, H, I] down); routing is
uniform random top-8 of 128 (seeded), which spreads rows like the random-weight router does.
Reported per GEMM: median microseconds over CUDA-event-timed launches, and the bytes of the
experts that have rows divided by that time (the kernel's share of the H200's ~4.3 TB/s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexgemma.model.moe import _segment_mm  # noqa: E402


def time_us(fn, iters: int = 40, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="8,32,64")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from flexgemma.model.moe_kernel import expert_rows_mm

    dev, dt = torch.device("cuda"), torch.bfloat16
    e, h, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(e, 2 * i, h, device=dev, dtype=dt, generator=g) * 0.02
    down = torch.randn(e, h, i, device=dev, dtype=dt, generator=g) * 0.02
    grid = list(itertools.product((32, 64, 128), (128, 256), (4, 8), (2, 3, 4)))
    res: dict = {"shape": {"experts": e, "hidden": h, "intermediate": i, "top_k": k}, "runs": []}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        idx = torch.stack([torch.randperm(e, device=dev, generator=g)[:k] for _ in range(bs)])
        flat = idx.reshape(-1)
        counts = torch.bincount(flat, minlength=e)
        ends = torch.cumsum(counts, 0).to(torch.int32)
        used = int((counts > 0).sum())
        x_up = torch.randn(bs * k, h, device=dev, dtype=dt, generator=g)
        x_down = torch.randn(bs * k, i, device=dev, dtype=dt, generator=g)
        for name, x, w in (("gate_up", x_up, gate_up), ("down", x_down, down)):
            nbytes = used * w[0].numel() * w.element_size()
            ref = _segment_mm(x, w.transpose(1, 2), ends)
            row = {"batch": bs, "gemm": name, "experts_used": used, "bytes": nbytes,
                   "grouped_mm_us": time_us(lambda: _segment_mm(x, w.transpose(1, 2), ends))}
            row["grouped_mm_tb_s"] = nbytes / row["grouped_mm_us"] / 1e6
            configs = []
            for bn, bk, warps, stages in grid:
                fn = lambda: expert_rows_mm(x, w, ends, bn, bk, warps, stages)  # noqa: E731
                try:
                    err = (fn().float() - ref.float()).abs().max().item()
                    us = time_us(fn)
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit this GPU
                    configs.append({"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages,
                                    "error": str(exc).splitlines()[0][:120]})
                    continue
                configs.append({"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages,
                                "us": us, "tb_s": nbytes / us / 1e6, "max_abs_err": err})
            ok = [c for c in configs if "us" in c]
            best = min(ok, key=lambda c: c["us"])
            row.update({"triton_best": best, "triton_configs": configs,
                        "triton_default_us": next(c["us"] for c in ok if (c["block_n"], c["block_k"], c["num_warps"],
                                                                          c["num_stages"]) == (64, 128, 4, 3))})
            res["runs"].append(row)
            print(f"bs {bs:3d} {name:7s} experts {used:3d} {nbytes / 1e6:7.1f} MB: grouped_mm {row['grouped_mm_us']:7.1f} us "
                  f"({row['grouped_mm_tb_s']:.2f} TB/s), triton default {row['triton_default_us']:7.1f} us, best "
                  f"{best['us']:7.1f} us ({best['tb_s']:.2f} TB/s) at block_n {best['block_n']} block_k {best['block_k']} "
                  f"warps {best['num_warps']} stages {best['num_stages']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
