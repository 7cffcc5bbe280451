"""The decode step's tail alone: soft-capped logits and the sampler over a 262k vocabulary, as the
engine compiles them, the cap inside the sampler's graph (reading the head's bf16 output) against the
cap as a separate step writing float32 logits that the sampler reads (the engine before 9214d71).

    python experiments/bench_sampler.py --rows 64,256,512 --out sampler.json
    python experiments/bench_sampler.py --device cpu --eager --rows 2 --vocab 1024   # smoke test

Median microseconds of 50 timed calls per (rows, greedy or sampled): CUDA events on the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexgemma.model.compiled import CompileCounter, compile_fn  # noqa: E402
from flexgemma.engine.sampler import SamplingBatch, sample  # noqa: E402
from flexgemma.model.glue import final_logits  # noqa: E402
from flexgemma.tasks.common import cuda_time_ms  # noqa: E402


def wall_ms(fn, iters: int = 10) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,256,512")
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--softcap", type=float, default=30.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (the CPU smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev, cap = torch.device(args.device), args.softcap
    counter = CompileCounter()
    compiled = (lambda fn: fn) if args.eager else (lambda fn: compile_fn(fn, counter))  # noqa: E731
    fused, cap_fn, sample_fn = compiled(sample), compiled(final_logits), compiled(sample)
    timer = cuda_time_ms if dev.type == "cuda" else wall_ms
    rows_out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        head = (torch.randn(rows, args.vocab, device=dev) * 20).bfloat16()
        for greedy in (True, False):
            r = torch.arange(rows, device=dev)
            batch = SamplingBatch(torch.full((rows,), 0.0 if greedy else 1.0, device=dev),
                                  torch.zeros(rows, dtype=torch.long, device=dev), torch.ones(rows, device=dev),
                                  r + 1, r + 100, needs_filter=False, greedy_only=greedy)
            a = fused(head, batch, cap)
            b = sample_fn(cap_fn(head, cap), batch)
            row = {"rows": rows, "greedy": greedy, "tokens_equal": bool(torch.equal(a[0], b[0])),
                   "logprob_max_diff": float((a[1] - b[1]).abs().max()),
                   "cap_inside_us": timer(lambda: fused(head, batch, cap)) * 1e3,
                   "cap_apart_us": timer(lambda: sample_fn(cap_fn(head, cap), batch)) * 1e3}
            rows_out.append(row)
            print(f"rows {rows:4d} {'greedy ' if greedy else 'sampled'}: cap inside the sampler "
                  f"{row['cap_inside_us']:7.1f} us, apart {row['cap_apart_us']:7.1f} us; tokens equal "
                  f"{row['tokens_equal']}, logprob max diff {row['logprob_max_diff']:.1e}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"vocab": args.vocab, "softcap": cap, "rows": rows_out}, indent=1))
    return rows_out


if __name__ == "__main__":
    main()
