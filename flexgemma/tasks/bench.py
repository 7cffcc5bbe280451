"""task=bench: throughput, latency and memory over timed rounds of the workload.

Build (model, compile, graph capture) and warm-up rounds are outside every timed window.
Each round re-runs the same prompts; identical outputs across rounds are the run-to-run
determinism check.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from flexgemma.tasks.common import memory_metrics, round_metrics


def run(engine, workload, cfg, recorder) -> dict:
    w = cfg.workload
    for _ in range(int(w.warmup_rounds)):
        engine.generate(workload.prompts, workload.params)
    rounds, latencies, first = [], [], None
    deterministic = True
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for r in range(int(w.rounds)):
        t0 = time.perf_counter()
        outs = engine.generate(workload.prompts, workload.params, use_tqdm=True)
        wall = time.perf_counter() - t0
        m, lat = round_metrics(outs, engine.stats, wall)
        m["round"] = r
        recorder.log_round(m)
        rounds.append(m)
        latencies.append(lat)
        tokens = [o.token_ids for o in outs]
        if first is None:
            first = tokens
        elif tokens != first:
            deterministic = False
    summary = {}
    for key in ("throughput/total_tok_s", "throughput/decode_tok_s", "throughput/prefill_tok_s"):
        vals = [m[key] for m in rounds]
        summary[key + "_median"] = statistics.median(vals)
        summary[key + "_best"] = max(vals)
    for key in ("latency/ttft_ms", "latency/tpot_ms"):
        vals = np.concatenate([lat[key] for lat in latencies])
        name = key.removesuffix("_ms")
        summary[name + "_p50_ms"] = float(np.percentile(vals, 50)) if vals.size else None
        summary[name + "_p99_ms"] = float(np.percentile(vals, 99)) if vals.size else None
    summary["bench/rounds"] = len(rounds)
    summary["bench/generated_tokens_per_round"] = rounds[0]["bench/generated_tokens"]
    summary["bench/round_seconds_median"] = statistics.median(m["bench/round_seconds"] for m in rounds)
    summary["determinism/run_to_run"] = deterministic
    summary.update(memory_metrics(engine))
    summary["samples"] = sample_completions(engine, workload, first)
    return summary


def sample_completions(engine, workload, tokens, n: int = 3) -> list[dict]:
    out = []
    for prompt, gen in list(zip(workload.prompts, tokens or []))[:n]:
        item = {"prompt_tokens": len(prompt), "completion_ids": gen[:32]}
        if engine.tokenizer is not None:
            item["completion"] = engine.tokenizer.decode(gen, skip_special_tokens=False)
        out.append(item)
    return out
