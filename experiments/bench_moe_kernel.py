"""The routed experts of one 26B-A4B layer at decode batch sizes, alone on the GPU: torch's path
(sort by expert, two grouped GEMMs, index_add) against the two Triton kernels of
`kernels.moe=triton` over a grid of tile options, bf16 and (with --bnb4) packed 4-bit, the
latter both decoded inside the GEMM kernels (the default) and dequantised into slots first.

    python experiments/bench_moe_kernel.py --batch-sizes 8,32,64 --out moe_kernel.json

Weights are random in the model's layout ([E, 2I, H] gate_up, [E, H, I] down); routing is uniform
random top-8 of 128 (seeded), which spreads rows like the random-weight router does. Reported: the
median microseconds of the whole routed-experts call (CUDA events), and the bytes of the experts
that have rows divided by that time (against the H200's ~4.3 TB/s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexgemma.model.moe import experts_grouped  # noqa: E402
from flexgemma.tasks.common import cuda_time_ms  # noqa: E402


def time_us(fn) -> float:
    return cuda_time_ms(fn, iters=40) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="8,32,64")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--grid-batch-sizes", default="8,32", help="batch sizes that also time the tile grid")
    ap.add_argument("--grid-quants", default="bf16", help="weight kinds that time a tile grid (bnb4: "
                    "the fused 4-bit kernels' BLOCK_N, warps and pipeline depth)")
    ap.add_argument("--block-m", default="16,32,64", help="entries per tile to time with the default tiles, "
                    "entries sorted and (up to kernels.moe_sort_above entries) matched; empty: none")
    ap.add_argument("--bnb4", action="store_true", help="also the packed 4-bit experts (needs bitsandbytes)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers.activations import GELUTanh

    from flexgemma.config.kernels import Kernels
    from flexgemma.model.moe_kernel import DOWN_TILES, UP_TILES, block_m_for, decode_experts

    sort_above = Kernels().moe_sort_above  # steps of more entries sort them by default

    dev, dt = torch.device("cuda"), torch.bfloat16
    e, h, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    g = torch.Generator(device=dev).manual_seed(0)
    weights = {"bf16": ((torch.randn(e, 2 * i, h, device=dev, dtype=dt, generator=g) * 0.02),
                        (torch.randn(e, h, i, device=dev, dtype=dt, generator=g) * 0.02))}
    if args.bnb4:
        from flexgemma.model.quant import Bnb4Settings, PackedExpertWeight

        s = Bnb4Settings(double_quant=True)
        weights["bnb4"] = tuple(PackedExpertWeight.pack(w, s, dev) for w in weights["bf16"])
    act = GELUTanh()
    # (up BLOCK_N, down BLOCK_N, BLOCK_K, num_warps, num_stages); the up kernel reads a gate and an up
    # tile per step, so its BLOCK_N streams twice as many weight rows
    grid = list(itertools.product((32, 64), (64, 128), (128, 256), (4, 8), (3,), ("table",)))
    # fused 4-bit steps are one quantisation block each (BLOCK_K unused); each kernels.moe_code_lookup
    grid_4bit = list(itertools.product((32, 64), (64, 128), (64,), (4, 8), (3,), ("table", "select", "prmt")))
    grid_sizes = {int(b) for b in args.grid_batch_sizes.split(",")}
    grid_quants = set(args.grid_quants.split(","))
    res: dict = {"shape": {"experts": e, "hidden": h, "intermediate": i, "top_k": k},
                 "default": {"up": UP_TILES, "down": DOWN_TILES}, "runs": []}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        idx = torch.stack([torch.randperm(e, device=dev, generator=g)[:k] for _ in range(bs)])
        w = torch.softmax(torch.randn(bs, k, device=dev, generator=g), -1)
        x = torch.randn(bs, h, device=dev, dtype=dt, generator=g)
        used = int(idx.unique().numel())
        for quant, (gate_up, down) in weights.items():
            # bytes of one expert's two matrices as stored (4-bit: the packed nibbles; scales are ~1.6% more)
            per_expert = (gate_up[0].numel() + down[0].numel()) * 2 if quant == "bf16" else \
                (gate_up.packed[0].numel() + down.packed[0].numel())
            nbytes = used * per_expert
            ref = experts_grouped(x, idx, w, gate_up, down, act).float()
            row = {"batch": bs, "quant": quant, "experts_used": used, "bytes": nbytes,
                   "torch_us": time_us(lambda: experts_grouped(x, idx, w, gate_up, down, act))}
            row["default_us"] = time_us(lambda: decode_experts(x, idx, w, gate_up, down))
            # the two ways a program finds its expert's entries (the default switches above sort_above)
            row["sorted_us"] = time_us(lambda: decode_experts(x, idx, w, gate_up, down, sort_entries=True))
            if bs * k <= sort_above:
                row["matched_us"] = time_us(lambda: decode_experts(x, idx, w, gate_up, down, sort_entries=False))
            row["block_m_default"] = block_m_for(bs * k, e, quant == "bnb4")
            row["block_m"] = {}
            for bm in [int(b) for b in args.block_m.split(",") if b]:
                tiles = {"BLOCK_M": bm}
                for mode, sort in (("sorted", True), ("matched", False)):
                    if sort or bs * k <= sort_above:
                        row["block_m"][f"{bm} {mode}"] = time_us(
                            lambda: decode_experts(x, idx, w, gate_up, down, tiles, tiles, sort_entries=sort))
            if quant == "bnb4":  # the default is the fused 4-bit GEMMs; the other mode dequantises into slots
                row["slots_us"] = time_us(lambda: decode_experts(x, idx, w, gate_up, down, packed_mode="slots"))
                row["select_us"] = time_us(lambda: decode_experts(x, idx, w, gate_up, down, kernels=Kernels(moe_code_lookup="select")))
            configs = []
            for ubn, dbn, bk, warps, stages, lookup in (grid_4bit if quant == "bnb4" else grid) \
                    if quant in grid_quants and bs in grid_sizes else []:
                up = dict(BLOCK_N=ubn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                dn = dict(BLOCK_N=dbn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                fn = lambda: decode_experts(x, idx, w, gate_up, down, up, dn, kernels=Kernels(moe_code_lookup=lookup))  # noqa: E731
                c = {"up": up, "down": dn, "code_lookup": lookup}
                try:
                    got = fn().float()
                    c["rel_err"] = ((got - ref).norm() / ref.norm()).item()
                    c["us"] = time_us(fn)
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit this GPU
                    c["error"] = str(exc).splitlines()[0][:120]
                configs.append(c)
            ok = [c for c in configs if "us" in c] or [
                {"up": UP_TILES, "down": DOWN_TILES, "us": row["default_us"],
                 "rel_err": ((decode_experts(x, idx, w, gate_up, down).float() - ref).norm() / ref.norm()).item()}]
            best = min(ok, key=lambda c: c["us"])
            row.update({"best": best, "configs": configs})
            res["runs"].append(row)
            print(f"bs {bs:3d} {quant:4s} experts {used:3d} {nbytes / 1e6:7.1f} MB: torch {row['torch_us']:7.1f} us "
                  f"({nbytes / row['torch_us'] / 1e6:.2f} TB/s), triton default {row['default_us']:7.1f} us "
                  f"({nbytes / row['default_us'] / 1e6:.2f} TB/s), best {best['us']:7.1f} us "
                  f"({nbytes / best['us'] / 1e6:.2f} TB/s) up {best['up']} down {best['down']['BLOCK_N']}, "
                  f"entries sorted {row['sorted_us']:7.1f} us / matched {row.get('matched_us', float('nan')):7.1f} us, "
                  + (f"lookup {best.get('code_lookup')}, slots {row['slots_us']:7.1f} us, select "
                     f"{row['select_us']:7.1f} us, " if "slots_us" in row else "") +
                  f"rel err {best['rel_err']:.1e}", flush=True)
            # the per-expert entry counts this routing gives (a busy expert past BLOCK_M takes two tiles)
            counts = torch.bincount(idx.reshape(-1), minlength=e)
            row["entries_per_expert"] = {"mean": counts.float().mean().item(), "max": int(counts.max())}
            if row["block_m"]:
                print(f"    entries per expert mean {row['entries_per_expert']['mean']:.1f} max "
                      f"{row['entries_per_expert']['max']}; BLOCK_M (default {row['block_m_default']}): "
                      + ", ".join(f"{key} {us:.1f} us" for key, us in row["block_m"].items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
