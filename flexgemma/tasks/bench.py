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

from flexgemma.tasks.common import (bandwidth_metrics, bounded, memory_metrics, prefix_metrics, request_error_metrics,
                                    round_metrics)


def run(engine, workload, cfg, recorder) -> dict:
    w = cfg.workload
    for _ in range(int(w.warmup_rounds)):
        engine.reset_prefix_cache()  # every round computes its prompts (sharing only within the round)
        engine.generate(workload.prompts, workload.params)
    rounds, latencies, first, first_outputs = [], [], None, []
    deterministic = True
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is not None:  # bucket hits and padding of the timed rounds only
        graphs.hits.clear()
        graphs.padded_rows = graphs.real_rows = 0
    for r in range(int(w.rounds)):
        engine.reset_prefix_cache()  # no round reuses an earlier round's prompt KV
        t0 = time.perf_counter()
        outs = engine.generate(workload.prompts, workload.params, use_tqdm=True)
        wall = time.perf_counter() - t0
        m, lat = round_metrics(outs, engine.stats, wall)
        m.update(bandwidth_metrics(engine, outs, engine.stats))
        m["round"] = r
        recorder.log_round(m)
        rounds.append(m)
        latencies.append(lat)
        tokens = [o.token_ids for o in outs]
        if first is None:
            first, first_outputs = tokens, outs
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
    for key in ("bandwidth/decode_gb_s", "bandwidth/decode_pct_of_peak"):
        if key in rounds[0]:
            summary[key + "_median"] = statistics.median(m[key] for m in rounds)
    if "bandwidth/gpu_peak_gb_s" in rounds[0]:
        summary["bandwidth/gpu_peak_gb_s"] = rounds[0]["bandwidth/gpu_peak_gb_s"]
    if graphs is not None:
        summary.update(graphs.metrics())
    summary["bench/rounds"] = len(rounds)
    summary["bench/generated_tokens_per_round"] = rounds[0]["bench/generated_tokens"]
    summary["bench/round_seconds_median"] = statistics.median(m["bench/round_seconds"] for m in rounds)
    summary["determinism/run_to_run"] = deterministic
    summary.update(memory_metrics(engine))
    summary.update(prefix_metrics(engine.stats))  # the last timed round's
    completions = workload.completion_rows(first_outputs, engine.tokenizer)
    recorder.write_completions(completions)
    summary["samples"] = sample_completions(completions)
    summary.update(request_error_metrics(first_outputs))
    return summary


def sample_completions(rows: list[dict], n: int = 3) -> list[dict]:
    """A few completions of the first timed round for the summary (all of them: completions.jsonl)."""
    keep = ("prompt_index", "sample", "prompt", "prompt_tokens", "completion", "finish_reason")
    return [bounded({**{k: r[k] for k in keep if k in r}, "completion_ids": r["token_ids"][:32]}) for r in rows[:n]]
