"""task=bench: throughput, latency and memory over timed rounds of the workload.

Build (model, compile, graph capture) and warm-up rounds are outside every timed window.
Each round re-runs the same prompts; identical outputs across rounds are the run-to-run
determinism check.
"""

from __future__ import annotations

import statistics

import numpy as np
import torch

from flexgemma.config.schema import Config
from flexgemma.tasks.common import (bandwidth_metrics, bounded, memory_metrics, prefix_metrics, request_error_metrics,
                                    round_metrics, timed_rounds)

THROUGHPUTS = ("throughput/output_tok_s", "throughput/total_tok_s", "throughput/requests_s",
               "throughput/decode_tok_s", "throughput/prefill_tok_s")


def run(engine, workload, cfg: Config, recorder) -> dict:
    rounds, latencies, outputs = logged_rounds(engine, workload, cfg.workload, recorder)
    first = [o.token_ids for o in outputs[0]]
    summary = round_summary(rounds, latencies)
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is not None:
        summary.update(graphs.metrics())
    summary["determinism/run_to_run"] = all([o.token_ids for o in outs] == first for outs in outputs)
    summary.update(memory_metrics(engine))
    summary.update(prefix_metrics(engine.stats))  # the last timed round's
    completions = workload.completion_rows(outputs[0], engine.tokenizer)
    recorder.write_completions(completions)
    summary["samples"] = sample_completions(completions)
    summary.update(request_error_metrics(outputs[0]))
    return summary


def logged_rounds(engine, workload, w, recorder):
    """The workload's warm-up and timed rounds (tasks.common.timed_rounds), each timed round's metrics
    logged; returns (round metrics, latencies, outputs)."""
    rounds, latencies = [], []

    def reset() -> None:  # peak memory, bucket hits and padding of the timed rounds only
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        graphs = getattr(engine.runner, "graphs", None)
        if graphs is not None:
            graphs.hits.clear()
            graphs.padded_rows = graphs.real_rows = 0

    def log(r: int, timed) -> None:
        m, lat = round_metrics(timed.outputs, timed.stats, timed.wall)
        m.update(timed.watch)
        m.update(bandwidth_metrics(engine, timed.outputs, timed.stats))
        m["round"] = r
        recorder.log_round(m)
        rounds.append(m)
        latencies.append(lat)

    timed = timed_rounds(engine, workload.prompts, workload.params, int(w.rounds), int(w.warmup_rounds),
                         progress=True, before_timed=reset, on_round=log)
    return rounds, latencies, [t.outputs for t in timed]


def round_summary(rounds: list[dict], latencies: list[dict]) -> dict:
    """Medians and bests over the timed rounds; latency means and percentiles over every request."""
    summary = {}
    for key in THROUGHPUTS:
        vals = [m[key] for m in rounds]
        summary[key + "_median"] = statistics.median(vals)
        summary[key + "_best"] = max(vals)
    for key in ("latency/ttft_ms", "latency/tpot_ms", "latency/itl_ms"):
        vals = np.concatenate([lat[key] for lat in latencies])
        name = key.removesuffix("_ms")
        summary[name + "_mean_ms"] = float(vals.mean()) if vals.size else None
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_ms"] = float(np.percentile(vals, q)) if vals.size else None
    for key in ("bandwidth/decode_gb_s", "bandwidth/decode_pct_of_peak", "latency/decode_gpu_step_ms",
                "scheduler/gpu_idle_pct"):
        if key in rounds[0]:
            summary[key + "_median"] = statistics.median(m[key] for m in rounds)
    if "bandwidth/gpu_peak_gb_s" in rounds[0]:
        summary["bandwidth/gpu_peak_gb_s"] = rounds[0]["bandwidth/gpu_peak_gb_s"]
    seconds = [m["bench/round_seconds"] for m in rounds]
    summary.update({"bench/rounds": len(rounds), "bench/generated_tokens_per_round": rounds[0]["bench/generated_tokens"],
                    "bench/round_seconds_median": statistics.median(seconds),
                    "bench/compiled_in_rounds": sum(m["bench/compiled_in_round"] for m in rounds)})
    summary.update(first_round_check(seconds))
    return summary


def first_round_check(seconds: list[float], tolerance: float = 0.05) -> dict:
    """The first timed round's speed over the median's (the same work each round, so the inverse
    ratio of their times): under 1 - tolerance, something compiled or allocated inside it."""
    ratio = statistics.median(seconds) / seconds[0]
    return {"bench/first_round_ratio": ratio, "bench/first_round_within_5pct": ratio >= 1 - tolerance}


def sample_completions(rows: list[dict], n: int = 3) -> list[dict]:
    """A few completions of the first timed round for the summary (all of them: completions.jsonl)."""
    keep = ("prompt_index", "sample", "prompt", "prompt_tokens", "completion", "finish_reason")
    return [bounded({**{k: r[k] for k in keep if k in r}, "completion_ids": r["token_ids"][:32]}) for r in rows[:n]]
