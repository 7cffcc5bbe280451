"""quant=bnb4 on the GPU: peak memory, throughput and the 4-bit fraction, against bf16.

Cases (each in a fresh process, so peak memory is the case's own):
  26b_bs8   26B-A4B, 8 prompts of 128 tokens + 256 new, batch 8
  26b_bs32  26B-A4B, 32 prompts of 128 tokens + 256 new, batch 32
  e2b       E2B on the speed workload (+experiment=speed_e2b: 64 x (64..512 + 512))
Each runs with quant=bnb4 (and, with --bf16, quant=bf16 for the ratio). The KV pool is sized for
the workload (kv.max_pages), not for the card, so peak memory is what the job needs.

    python experiments/bench_bnb4.py --cases 26b_bs8,26b_bs32,e2b --bf16 --out bench_bnb4.json
    python experiments/bench_bnb4.py --cases e2b -- quant.double_quant=true   # extra overrides after --
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

GB = 1e9

CASES = {
    "26b_bs8": ["+model=26b_a4b", "workload.num_prompts=8", "engine.max_batch_size=8", "cudagraph.buckets=[1,2,4,8]"],
    "26b_bs32": ["+model=26b_a4b", "workload.num_prompts=32", "engine.max_batch_size=32",
                 "cudagraph.buckets=[1,2,4,8,16,24,32]"],
    "e2b": ["+model=e2b", "+experiment=speed_e2b"],
}
_26B_WORKLOAD = ["workload.min_prompt_len=128", "workload.max_prompt_len=128", "workload.max_new_tokens=256",
                 "workload.rounds=3", "workload.warmup_rounds=1", "engine.max_model_len=512", "kv.page_size=64",
                 "kv.max_pages=300"]  # 32 sequences x 6 pages of 64 tokens + slack


def overrides_for(case: str, quant: str, extra: list[str]) -> list[str]:
    out = list(CASES[case])
    if case.startswith("26b"):
        out += _26B_WORKLOAD
    return out + [f"quant={quant}", "device=cuda", *extra]


def run_case(overrides: list[str]) -> dict:
    """In this process: build, warm up, time rounds; peak memory over build and rounds."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flexgemma import build_engine, compose
    from flexgemma.model.quant import storage_census
    from flexgemma.tasks.common import timed_rounds
    from flexgemma.run.tracking import environment
    from flexgemma.tasks.workload import synthetic

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    cfg = compose(overrides)
    engine = build_engine(cfg)
    build_s = time.perf_counter() - t0
    build_peak = torch.cuda.max_memory_allocated()
    w = cfg.workload
    work = synthetic(w, engine.spec.vocab_size)
    rounds = timed_rounds(engine, work.prompts, work.params, int(w.rounds), int(w.warmup_rounds))
    tok_s = [r.tok_s for r in rounds]
    decode_tok_s = [r.stats.decode_tokens / r.stats.decode_time if r.stats.decode_time else 0.0 for r in rounds]
    census = storage_census(engine.model)
    res = {
        "overrides": overrides,
        "build_seconds": build_s,
        "tok_s_median": statistics.median(tok_s),
        "decode_tok_s_median": statistics.median(decode_tok_s),
        "tok_s_rounds": tok_s,
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / GB,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / GB,
        "build_peak_allocated_gb": build_peak / GB,
        "kv_pool_gb": engine.info["kv_pool_bytes"] / GB,
        "weights_gb": census["quant/weight_bytes"] / GB,
        "params": census["params"],
        "quant/fraction_4bit": census["quant/fraction_4bit"],
        "engine": engine.info,
    }
    res.update(environment())
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="26b_bs8,26b_bs32,e2b")
    ap.add_argument("--bf16", action="store_true", help="also run quant=bf16 for the throughput ratio")
    ap.add_argument("--quant", default="bnb4")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: JSON overrides
    args, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    if args.one is not None:
        print("RESULT " + json.dumps(run_case(json.loads(args.one)), default=str))
        return
    results = {}
    for case in args.cases.split(","):
        for quant in [args.quant] + (["bf16"] if args.bf16 else []):
            ov = overrides_for(case, quant, extra)
            proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(ov)], capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            results[f"{case}/{quant}"] = (json.loads(line[7:]) if line else
                                          {"error": proc.stderr[-3000:], "returncode": proc.returncode})
            r = results[f"{case}/{quant}"]
            print(f"{case:9s} {quant:8s} " + (
                f"tok/s {r['tok_s_median']:9.1f}  decode tok/s {r['decode_tok_s_median']:9.1f}  "
                f"peak {r['peak_allocated_gb']:6.2f} GB (build {r['build_peak_allocated_gb']:.2f}, "
                f"KV {r['kv_pool_gb']:.2f}, weights {r['weights_gb']:.2f})  4-bit {r['quant/fraction_4bit']:.3f}"
                if "error" not in r else "FAILED: " + r["error"].strip().splitlines()[-1]), flush=True)
        if args.bf16 and "error" not in results.get(f"{case}/bf16", {"error": 1}) and \
                "error" not in results[f"{case}/{args.quant}"]:
            ratio = results[f"{case}/{args.quant}"]["tok_s_median"] / results[f"{case}/bf16"]["tok_s_median"]
            results[f"{case}/ratio_vs_bf16"] = ratio
            print(f"{case:9s} {args.quant} / bf16 throughput: {ratio:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
