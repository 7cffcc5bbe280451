"""Metrics shared by the tasks."""

from __future__ import annotations

import resource
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

GIB = float(2**30)


@dataclass
class TimedRound:
    """One timed engine.generate over a workload: its outputs, the engine's step counters of that
    round (engine.stats, new each generate) and what compiled or grew inside it (RoundWatch)."""

    wall: float  # seconds, the GPU synchronised at both ends
    outputs: list  # RequestOutput per request
    stats: Any  # engine.StepStats of the round
    watch: dict  # bench/compiled_in_round, bench/reserved_growth_gib

    @property
    def tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def token_ids(self) -> list:
        return [o.token_ids for o in self.outputs]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall

    @property
    def compiled(self) -> int:
        return self.watch["bench/compiled_in_round"]

    @property
    def gpu_idle_pct(self) -> Optional[float]:
        """scheduler/gpu_idle_pct of the round (async decode on a GPU)."""
        return gpu_decode_metrics(self.stats).get("scheduler/gpu_idle_pct")

    @property
    def decode_step_ms(self) -> float:
        return self.stats.decode_time / max(self.stats.decode_steps, 1) * 1e3


SAMPLE_CHARS = 240  # a sample's text keeps its first and last half of this
SAMPLE_ITEMS = 32  # a sample's list (token ids, chat messages) keeps its first and last half of this


def bounded(value, chars: int = SAMPLE_CHARS, items: int = SAMPLE_ITEMS):
    """`value` cut to a bounded size for summary.json: long text and long lists keep their start and
    end with a marker saying how much was left out (completions.jsonl keeps everything)."""
    if isinstance(value, str) and len(value) > chars:
        half = chars // 2
        return f"{value[:half]} …[{len(value) - 2 * half} of {len(value)} chars left out]… {value[-half:]}"
    if isinstance(value, (list, tuple)):
        if len(value) > items:
            half = items // 2
            value = [*value[:half], f"…[{len(value) - 2 * half} of {len(value)} items left out]…", *value[-half:]]
        return [bounded(v, chars, items) for v in value]
    if isinstance(value, dict):
        return {k: bounded(v, chars, items) for k, v in value.items()}
    return value


def request_error_metrics(outputs) -> dict:
    """How many requests of a round ended in an error, and the first error (a job whose every
    request errored is failed, not ok)."""
    errored = [o for o in outputs if o.finish_reason == "error"]
    out = {"requests/errors": len(errored), "requests/total": len(outputs)}
    if errored:
        out["requests/first_error"] = bounded(str(errored[0].error), chars=2000)
    return out


def cuda_time_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of fn() on the GPU, each call between two CUDA events (the kernel
    benchmarks' and the decode profiler's timer)."""
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
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def graph_time_ms(fn, calls: int = 20, replays: int = 10) -> float:
    """GPU milliseconds of one fn() with the host out of the measure: `calls` calls captured in one
    CUDA graph, the median replay over `replays` divided by `calls`. For kernels shorter than their
    launch: cuda_time_ms' events also time the host's launch of a compiled call (the flex decode
    sweep timed identical options 0.17 and 0.29 ms a call where the graphs' kernel ran 0.12)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time_ms(graph.replay, iters=replays, warmup=2) / calls


def expected_tokens(prompts, params) -> Optional[int]:
    """Most tokens a generate() of these prompts can produce (exact when EOS is ignored)."""
    if isinstance(params, (list, tuple)):
        return sum(int(p.max_new_tokens) for p in params)
    return len(prompts) * int(params.max_new_tokens) if params is not None else None


@contextmanager
def token_progress(engine, desc: str, total: Optional[int] = None, interval: float = 0.25,
                   disable: Optional[bool] = None):
    """A tqdm bar of generated tokens (and tokens/s) while the body runs: a daemon thread polls
    engine.tokens_generated, so generate() itself is untouched. Shown on a terminal only (a sweep
    job's log gets no carriage-return lines)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="tok", disable=disable, leave=True)
    if bar.disable:
        yield bar
        return
    start, stop = engine.tokens_generated, threading.Event()

    def poll():
        while not stop.wait(interval):
            bar.update(engine.tokens_generated - start - bar.n)

    thread = threading.Thread(target=poll, name="token-progress", daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()
        bar.update(engine.tokens_generated - start - bar.n)
        if bar.total is not None and bar.n < bar.total:
            bar.total = bar.n  # requests that stopped at EOS: the bar ends full
            bar.refresh()
        bar.close()


def timed_rounds(engine, prompts, params, rounds: int, warmup: int = 0, progress: bool = False,
                 before_timed: Optional[Callable[[], None]] = None,
                 on_round: Optional[Callable[[int, TimedRound], None]] = None) -> list[TimedRound]:
    """`warmup` untimed rounds, then `rounds` timed ones: the one loop of task=bench and the benchmark
    scripts. Every round starts with an empty prefix cache (sharing only within the round); a timed
    one has the GPU synchronised at both ends and is watched for graphs compiled inside it.
    before_timed() runs once between the warm-up and the first timed round, on_round(i, round) after
    each timed round (task=bench resets and logs its metrics there); `progress`: a tqdm bar of
    tokens on a terminal."""
    from flexgemma.engine.warm import RoundWatch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    total, disable = expected_tokens(prompts, params), None if progress else True
    for i in range(warmup):
        engine.reset_prefix_cache()
        with token_progress(engine, f"warm-up {i + 1}/{warmup}", total, disable=disable):
            engine.generate(prompts, params)
    sync()
    if before_timed is not None:
        before_timed()
    out, watch = [], RoundWatch(engine)
    for r in range(rounds):
        engine.reset_prefix_cache()
        with token_progress(engine, f"round {r + 1}/{rounds}", total, disable=disable):
            watch.start()
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            sync()
            wall = time.perf_counter() - t0
        out.append(TimedRound(wall, outs, engine.stats, watch.stop(f"batch {len(prompts)}, timed round {r}")))
        if on_round is not None:
            on_round(r, out[-1])
    return out


def round_metrics(outputs, stats, wall: float) -> tuple[dict, dict]:
    """(scalar metrics of one round, per-request latency arrays in ms)."""
    ok = [o for o in outputs if o.finish_reason != "error"]
    gen = sum(len(o.token_ids) for o in ok)
    prompt = sum(len(o.prompt_token_ids) for o in ok)
    ttft = np.array([o.first_token_time * 1e3 for o in outputs if o.first_token_time is not None])
    decoding = [o for o in outputs if o.finish_time is not None and o.first_token_time is not None
                and len(o.token_ids) > 1]
    tpot = np.array([(o.finish_time - o.first_token_time) * 1e3 / (len(o.token_ids) - 1) for o in decoding])
    # inter-token latency, vLLM's meaning: the gaps between consecutive tokens of a completion, over
    # every completion of every request (n > 1: each of the n)
    itl = np.concatenate([np.diff(c.token_times) * 1e3 for o in ok for c in o.outputs] or [np.zeros(0)])
    itl_mean = float(itl.mean()) if itl.size else None
    bs = stats.decode_batch_sizes
    return {
        "bench/round_seconds": wall,
        "bench/generated_tokens": gen,
        "bench/prompt_tokens": prompt,
        "throughput/output_tok_s": gen / wall,
        "throughput/total_tok_s": (prompt + gen) / wall,
        "throughput/requests_s": len(ok) / wall,
        "latency/itl_mean_ms": itl_mean,
        "throughput/decode_tok_s": stats.decode_tokens / stats.decode_time if stats.decode_time else 0.0,
        "throughput/prefill_tok_s": stats.prefill_tokens / stats.prefill_time if stats.prefill_time else 0.0,
        "scheduler/prefill_steps": stats.prefill_steps,
        "scheduler/decode_steps": stats.decode_steps,
        "scheduler/preemptions": stats.preemptions,
        "scheduler/decode_batch_mean": float(np.mean(bs)) if bs else 0.0,
        **prefix_metrics(stats),
        **gpu_decode_metrics(stats),
    }, {"latency/ttft_ms": ttft, "latency/tpot_ms": tpot, "latency/itl_ms": itl}


def gpu_decode_metrics(stats) -> dict:
    """Async decode on a GPU: the GPU's time a decode step, and the share of the decode loop it spent
    idle between chained steps waiting for the host to queue the next (a host-bound engine)."""
    if not stats.gpu_decode_steps:
        return {}
    busy, idle = stats.gpu_decode_busy, stats.gpu_decode_idle
    return {"latency/decode_gpu_step_ms": busy / stats.gpu_decode_steps * 1e3,
            "scheduler/gpu_idle_pct": 100.0 * idle / (busy + idle) if busy + idle else 0.0}


def prefix_metrics(stats) -> dict:
    """Prefix caching of one round: prompt tokens reused, prompt tokens computed, pages shared."""
    hit, computed = stats.prefix_hit_tokens, stats.prefill_tokens
    return {
        "kv/prefix_hit_tokens": hit,
        "kv/prefix_hit_rate": hit / (hit + computed) if hit + computed else 0.0,
        "throughput/prefill_tokens_computed": computed,
        "kv/shared_pages_peak": stats.shared_pages_peak,
    }


def memory_metrics(engine) -> dict:
    from flexgemma.model.quant import storage_census

    census = storage_census(engine.model)  # 4-bit weights with their quant states, packed experts included
    out = {
        "memory/weights_gib": census["quant/weight_bytes"] / GIB,
        "quant/fraction_4bit": census["quant/fraction_4bit"],
        "memory/kv_pool_gib": engine.info.get("kv_pool_bytes", 0) / GIB,
    }
    cache = engine.runner.cache
    peaks = engine.stats.kv_peak_pages
    out.update({f"kv/peak_pages_{name}": n for name, n in peaks.items()})

    def gib(pages: dict) -> float:  # page group -> pages, in GiB
        return sum(pages.get(g.name, 0) * cache.group_page_bytes(g) for g in cache.page_groups) / GIB

    out["memory/kv_in_use_peak_gib"] = gib(peaks)
    out["memory/kv_prompt_peak_gib"] = gib(engine.stats.kv_prompt_peak_pages)
    if getattr(engine, "lora", None) is not None:  # pristine copies are not parameters of the model
        out["memory/lora_pristine_gib"] = engine.info.get("lora_pristine_bytes", 0) / GIB
    if torch.cuda.is_available() and engine.info.get("device", "").startswith("cuda"):
        out["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        out["memory/peak_rss_gib"] = rss / (GIB if sys.platform == "darwin" else GIB / 1024)
    return out


# Peak memory bandwidth of GPUs flexgemma is measured on (GB/s, vendor figures). Others fall back to
# 2 x memory clock x bus width from the device properties when torch exposes them.
_PEAK_GB_S = {"H200": 4800.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0,
              "A100 80GB PCIe": 1935.0, "A100": 1555.0, "L40S": 864.0}


def gpu_peak_bandwidth_gb_s(device_index: int = 0) -> float | None:
    name = torch.cuda.get_device_name(device_index)
    for key, gb_s in _PEAK_GB_S.items():
        if key in name:
            return gb_s
    props = torch.cuda.get_device_properties(device_index)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None


def expert_weight_bytes(model) -> int:
    """Bytes held by the routed experts' weights (0 for a dense model), 4-bit packing included."""
    from flexgemma.model.quant import PackedExpertWeight

    total = 0
    for m in model.modules():
        if type(m).__name__ != "Gemma4TextExperts":
            continue
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(m, name)
            total += w.storage_bytes() if isinstance(w, PackedExpertWeight) else w.numel() * w.element_size()
    return total


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Experts a layer reads for `batch` rows when routing is uniform (random weights route so):
    each expert is missed by one row with probability 1 - k/E."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def weight_bytes_per_decode_step(model, batch: int | None = None) -> int:
    """Bytes of weights one decode step reads: every matrix once, but of embedding tables only the
    looked-up rows (negligible), except a tied LM head, which reads the whole token embedding.
    With `batch`, a MoE model's experts count only the share that `batch` rows route to (expected,
    uniform routing); without it, every expert."""
    from flexgemma.model.quant import storage_census

    embeddings = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    # all weight storage, 4-bit packing and quant states included, less the embedding tables
    total = storage_census(model)["quant/weight_bytes"]
    total -= sum(w.numel() * w.element_size() for w in embeddings.values())
    if model.config.tie_word_embeddings:
        w = model.get_input_embeddings().weight
        total += w.numel() * w.element_size()
    experts = expert_weight_bytes(model)
    if batch is not None and experts:
        cfg = model.config
        read = expected_distinct_experts(cfg.num_experts, cfg.top_k_experts, batch) / cfg.num_experts
        total -= round(experts * (1.0 - read))
    return total


def decode_kv_bytes(spec, outputs, element_size: int) -> int:
    """Bytes of K and V the decode steps of these requests read: at each step every layer reads its
    (source layer's) cache over the context, capped at the window on sliding layers."""
    per_token = {}  # window -> bytes per context token over the layers with that window
    for layer in spec.layers:
        per_token[layer.window] = per_token.get(layer.window, 0) + 2 * layer.num_kv_heads * layer.head_dim * element_size
    total = 0
    for o in outputs:
        n = len(o.token_ids)
        if n < 2:
            continue
        # decode step j (1..n-1) attends over prompt + j tokens; the first token came from prefill
        ctx = np.arange(len(o.prompt_token_ids) + 1, len(o.prompt_token_ids) + n, dtype=np.int64)
        for window, b in per_token.items():
            total += b * int((ctx if window is None else np.minimum(ctx, window)).sum())
    return total


def bandwidth_metrics(engine, outputs, stats) -> dict:
    """Achieved memory bandwidth of decode (an estimate: weights + KV read once per step), and its
    share of the GPU's peak."""
    if not stats.decode_time:
        return {}
    elem = engine.model.model.embed_tokens.weight.element_size()
    batch = round(stats.decode_tokens / stats.decode_steps) if stats.decode_steps else None
    moved = stats.decode_steps * weight_bytes_per_decode_step(engine.model, batch) + decode_kv_bytes(engine.spec, outputs, elem)
    out = {"bandwidth/decode_gb_s": moved / stats.decode_time / 1e9}
    if torch.cuda.is_available() and engine.info.get("device", "").startswith("cuda"):
        peak = gpu_peak_bandwidth_gb_s(torch.cuda.current_device())
        if peak:
            out["bandwidth/gpu_peak_gb_s"] = peak
            out["bandwidth/decode_pct_of_peak"] = 100.0 * out["bandwidth/decode_gb_s"] / peak
    return out
