"""The batch-invariant product (`engine.batch_invariant`: flexgemma/model/invariant/matmul.py) against cuBLAS
on a model's dense projections at RL row counts, over the keys and tiles that set its speed.

Issue 34's cost on the dense models is mostly these products: at a decode step of 256 rows E2B's o and
down projections had 48 output tiles of 64 x 128, fewer than `kernels.invariant_split_below_tiles`
(then 264), so they ran a program per tile and K chunk and wrote float32 partials, [K / invariant_k_chunk, rows,
N] of them, which the sum kernel read back: for E2B's down projection (K 12,288) twice its weights' bytes.
A larger `kernels.invariant_k_chunk` writes fewer partials (other bits: it fixes the order of a row's sums);
`invariant_split_below_tiles` and the tiles move only the speed. This times each combination on every
projection shape of one decode step of the model (its fused q/k/v, o, gate/up, down, per-layer-input and
router products; the routed experts are other kernels) and prints, per row count, each combination's
step total against cuBLAS's and the default's. Each product reads weights from copies that together
exceed the L2 cache, as a decode step's layers do. It also checks what the module promises: per
k_chunk, every tile, split or fold gives the same bits, and a row alone the bits it gets in the batch.

    python experiments/bench_invariant_linear.py --model e2b --rows 64,256
    python experiments/bench_invariant_linear.py --model 31b --rows 64 --k-chunks 512,2048 --out inv_linear.json
    python experiments/bench_invariant_linear.py --model e2b --rows 8192 --k-chunks 512  (a trainer micro-batch's rows)
    TRITON_INTERPRET=1 python experiments/bench_invariant_linear.py --model tiny --rows 5 --device cpu  (the checks)
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_linear4bit import time_us  # noqa: E402


def wall_us(fn, reps: int = 1) -> float:
    """Microseconds of fn() on the CPU (Triton's interpreter: for the bit checks, not a timing)."""
    import time

    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6

# the kernels' tile options (rows, features, K step, warps, stages, row tiles per band of the tile order);
# the module's own table is among them
TILES = [dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=s, GM=gm) for bm, bn, bk, w, s, gm in (
    (16, 64, 128, 4, 4, 8), (32, 64, 128, 4, 4, 8), (64, 64, 128, 4, 4, 8), (64, 128, 64, 4, 4, 8),
    (128, 64, 64, 4, 4, 8), (128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 3, 1), (64, 256, 64, 8, 3, 8),
    (128, 256, 64, 8, 3, 8), (256, 128, 64, 8, 3, 8), (128, 128, 64, 4, 4, 8))]
L2_BYTES = 128 << 20  # weights cycled through per timing: over the H100/H200's 50 MB L2


def projection_shapes(model: str) -> collections.Counter:
    """(N, K) -> how many of one decode step's dense products have that shape, from the model's published
    config (conf/model/MODEL.yaml) through its per-layer spec, projections fused as the engine fuses them."""
    from flexgemma import compose
    from flexgemma.model.estimate import _text_config
    from flexgemma.model.spec import ModelSpec

    config = _text_config(compose([f"+model={model}"]).model)
    spec = ModelSpec.from_hf_config(config)
    h, shapes = spec.hidden_size, collections.Counter()
    for layer in spec.layers:
        q = layer.num_heads * layer.head_dim
        kv = layer.num_kv_heads * layer.head_dim * (1 if layer.k_eq_v else 2) if layer.writes_kv else 0
        shapes[(q + kv, h)] += 1
        shapes[(h, q)] += 1
        shapes[(2 * layer.mlp_width, h)] += 1
        shapes[(h, layer.mlp_width)] += 1
        if layer.per_layer_input:
            shapes[(spec.per_layer_input_dim, h)] += 1
            shapes[(h, spec.per_layer_input_dim)] += 1
        if layer.moe:
            shapes[(int(config.num_experts), h)] += 1  # the router
    return shapes


# the fold kernel, with its chunk loop flattened (kernels.invariant_flatten), the split, the split whose chunks each
# tile's last program adds (kernels.invariant_split_sum=last_program); with "_tma" their blocks moved by tensor
# descriptors instead of per-element addresses (kernels.invariant_loads=tma; the fold's is the flattened one)
FORMS = ("fold", "flat", "split", "split_last", "flat_tma", "split_tma", "split_last_tma")


def run(x: torch.Tensor, w: torch.Tensor, k_chunk: int, tiles: dict, form: str) -> torch.Tensor:
    from flexgemma.model.invariant import triton_matmul as tm

    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    chunks = -(-x.shape[1] // k_chunk)
    tma = form.endswith("_tma")
    if form.startswith("split") and chunks > 1:
        split = tm.split_last_sums if form.startswith("split_last") else tm.split_then_sum
        split(x, w, out, chunks, k_chunk, tiles, tma=tma)
    else:
        tm.fold(x, w, out, k_chunk, tiles, flatten=form == "flat", tma=tma)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="e2b")
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--k-chunks", default="512,1024,2048,4096")
    ap.add_argument("--forms", default=",".join(FORMS), help="which of " + ", ".join(FORMS))
    ap.add_argument("--device", default="cuda", help="cpu: Triton's interpreter (TRITON_INTERPRET=1), the checks only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from flexgemma.model.invariant import matmul as M

    dev, dt = torch.device(args.device), torch.bfloat16
    timer = time_us if dev.type == "cuda" else wall_us
    torch.manual_seed(0)
    shapes = projection_shapes(args.model)
    print(f"# {args.model}: {sum(shapes.values())} dense products a decode step, {len(shapes)} shapes: "
          + ", ".join(f"{n}x{k} x{c}" for (n, k), c in sorted(shapes.items())), flush=True)
    k_chunks = [int(c) for c in args.k_chunks.split(",")]
    forms = args.forms.split(",")
    if set(forms) - set(FORMS):
        sys.exit(f"--forms: unknown {sorted(set(forms) - set(FORMS))}; choose from {', '.join(FORMS)}")
    res: dict = {"model": args.model, "shapes": {f"{n}x{k}": c for (n, k), c in shapes.items()}, "rows": {}}
    # "default": the product as the engine runs it with the kernels group's defaults, resolved for this device
    from flexgemma.config.resolve import resolve_kernels
    from flexgemma.config.schema import KernelsConfig

    kern = resolve_kernels(KernelsConfig(), dev, "dense", 64, False)
    engine_default = dict(k_chunk=kern.invariant_k_chunk, split_below_tiles=kern.invariant_split_below_tiles,
                          flatten=kern.invariant_flatten, split_sum=kern.invariant_split_sum, loads=kern.invariant_loads)
    for m in [int(r) for r in args.rows.split(",")]:
        # per shape: cuBLAS's time, the default's, and each (k_chunk, split, tiles) option's
        per_shape, mismatches = {}, []
        for (n, k), count in sorted(shapes.items()):
            copies = max(1, min(16, L2_BYTES // (n * k * 2)))
            ws = [torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(copies)]
            x = torch.randn(m, k, device=dev, dtype=dt)
            cycle = itertools.cycle(ws)
            times = {"cublas": timer(lambda: F.linear(x, next(cycle)), reps=copies),
                     "default": timer(lambda: M.linear(x, next(cycle), **engine_default), reps=copies)}
            for kc in k_chunks:
                first = None
                for form, tiles in itertools.product(forms, TILES):
                    if form.startswith("split") and -(-k // kc) == 1:
                        continue
                    y = run(x, ws[0], kc, tiles, form)
                    alone = run(x[:1].contiguous(), ws[0], kc, tiles, form)
                    first = y if first is None else first
                    if not (torch.equal(y, first) and torch.equal(alone[0], y[0])):
                        mismatches.append((n, k, kc, form, tiles))
                    key = f"k{kc}/{form}/{tiles['BM']}x{tiles['BN']}x{tiles['BK']}" \
                          f"w{tiles['num_warps']}s{tiles['num_stages']}g{tiles['GM']}"
                    times[key] = timer(lambda: run(x, next(cycle), kc, tiles, form), reps=copies)
            per_shape[f"{n}x{k}"] = {"count": count, "us": times}
            # --forms with splits only: a one-chunk shape has no option (it runs the fold)
            best = min(((v, kk) for kk, v in times.items() if kk not in ("cublas", "default")),
                       default=(times["default"], "default"))
            print(f"rows {m:4d} {n:6d}x{k:<6d} x{count:<3d} cuBLAS {times['cublas']:8.1f} us, default "
                  f"{times['default']:8.1f}, best {best[0]:8.1f} ({best[1]})", flush=True)
        # a step's total per choice: per k_chunk (one value for every shape: it is the arithmetic), each
        # shape at its fastest split/tile option, against cuBLAS and the default
        total = lambda pick: sum(s["count"] * pick(s["us"]) for s in per_shape.values())  # noqa: E731
        summary = {"cublas_us": total(lambda t: t["cublas"]), "default_us": total(lambda t: t["default"])}
        for kc in k_chunks:
            summary[f"k{kc}_best_us"] = total(
                lambda t: min((v for kk, v in t.items() if kk.startswith(f"k{kc}/")), default=t["default"]))
            if any(f.endswith("_tma") for f in forms):  # each shape's best form and tile, per way of loading
                for loads, is_tma in (("pointers", False), ("tma", True)):
                    summary[f"k{kc}_{loads}_best_us"] = total(lambda t: min(
                        (v for kk, v in t.items() if kk.startswith(f"k{kc}/") and kk.split("/")[1].endswith("_tma") == is_tma),
                        default=t["default"]))
            for form in forms:
                summary[f"k{kc}_{form}_only_us"] = total(
                    lambda t: min((v for kk, v in t.items() if kk.startswith(f"k{kc}/{form}/")), default=t["default"]))
        res["rows"][m] = {"shapes": per_shape, "summary": summary, "bit_mismatches": [list(map(str, mm))
                                                                                     for mm in mismatches]}
        print(f"rows {m}: a decode step's dense products: " + ", ".join(f"{k_} {v:9.1f}" for k_, v in summary.items())
              + f"; bits: {'every option equal' if not mismatches else f'{len(mismatches)} MISMATCHES'}", flush=True)
        for mm in mismatches[:8]:
            print(f"  other bits: {mm[0]}x{mm[1]} k_chunk {mm[2]} {mm[3]} {mm[4]}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
