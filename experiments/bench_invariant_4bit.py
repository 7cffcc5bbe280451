"""kernels.invariant_moe_4bit on one 26B-A4B MoE projection (GPU): the routed 4-bit experts dequantised
into slots then the invariant grouped product (dequant), against decoded inside the product (fused).
Checks the bits agree, then times both (tasks.common.cuda_time_ms: medians of --rounds, CUDA events).

    python experiments/bench_invariant_4bit.py [--tokens 32] [--rounds 20]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32, help="tokens a step (x 8 routed choices)")
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()

    from flexgemma.model.invariant import triton_matmul as tm
    from flexgemma.model.invariant.matmul import K_CHUNK, _tiles
    from flexgemma.model.moe_kernel import dequantize_slots
    from flexgemma.model.quant import Bnb4Settings, PackedExpertWeight
    from flexgemma.tasks.common import cuda_time_ms

    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    s = Bnb4Settings(block_size=64, quant_type="nf4", double_quant=True, compute_dtype=dt)
    w = PackedExpertWeight.pack(torch.randn(128, 1408, 2816, dtype=dt) * 0.02, s, dev)  # 26B-A4B's gate_up
    routed = torch.randint(0, 128, (a.tokens * 8,), device=dev)
    counts_all = torch.bincount(routed, minlength=128)
    ids = torch.nonzero(counts_all)[:, 0]
    counts = counts_all[ids]
    x = torch.randn(int(counts.sum()), 2816, dtype=dt, device=dev)
    cfg = _tiles(16 if x.shape[0] / ids.numel() <= 16 else 64, dt)

    def dequant():
        return tm.grouped(x, dequantize_slots(w, ids.to(torch.int32), dt), counts, K_CHUNK, cfg)

    def fused():
        return tm.grouped_4bit(x, w, ids, counts, K_CHUNK, cfg)

    print(f"# {a.tokens} tokens x 8 choices over {ids.numel()} experts; bits equal: {torch.equal(dequant(), fused())}")
    # a row's bits must not depend on the tile table entry (decode takes 16-row tiles, prefill 64)
    slots = dequantize_slots(w, ids.to(torch.int32), dt)
    outs = {f"{path} BM={rows}": fn(_tiles(rows, dt)) for rows in (16, 64) for path, fn in
            (("dequant", lambda c: tm.grouped(x, slots, counts, K_CHUNK, c)),
             ("fused", lambda c: tm.grouped_4bit(x, w, ids, counts, K_CHUNK, c)))}
    first = next(iter(outs))
    for name, o in outs.items():
        print(f"bits equal: {name} vs {first}: {torch.equal(o, outs[first])}")
    for name, fn in (("dequant", dequant), ("fused", fused)):
        print(f"{name:8s} {cuda_time_ms(fn, iters=a.rounds):8.3f} ms (median of {a.rounds})", flush=True)

if __name__ == "__main__":
    main()
