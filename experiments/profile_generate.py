"""Where a whole generate() round goes at an RL batch size: the GPU's time per decode step against
the host's, and the GPU's idle gaps between steps (a host-bound engine shows gaps).

    python experiments/profile_generate.py --model e2b --batch 256 --new-tokens 512
    python experiments/profile_generate.py --model tiny --device cpu --batch 8 --new-tokens 4   # smoke test

One build (the preset experiment=rl_batch_MODEL at --batch prompts, where one exists; otherwise
workload=rollout64), one untimed round, then one round with timers: the engine's own CUDA events around each async decode step (its
busy time on the GPU, and the gap from a step's end to the start of the step chained to it: what
scheduler/gpu_idle_pct sums), step by step, and wall-clock timers around the host's per-step work
(growing pages, filling the step's inputs and masks, reading the tokens, bookkeeping). Prints
medians per decode step and the round's split into prefill and decode.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexgemma import build_engine, compose  # noqa: E402
from flexgemma.config.compose import conf_dir  # noqa: E402
from flexgemma.engine.engine import StepStats  # noqa: E402
from flexgemma.tasks.workload import pool_demand, synthetic  # noqa: E402


def preset_overrides(model: str, batch: int, new_tokens, device: str, extra: list[str]) -> list[str]:
    """The RL preset of `model` at `batch` prompts, all at once; the caller's overrides last (they win)."""
    preset = f"rl_batch_{model}"
    workload = [f"+experiment={preset}"] if (conf_dir() / "experiment" / f"{preset}.yaml").is_file() \
        else ["workload=rollout64"]
    out = [f"+model={model}", *workload, f"workload.num_prompts={batch}", f"engine.max_batch_size={batch}",
           "workload.rounds=1", f"device={device}"]
    return out + ([f"workload.max_new_tokens={new_tokens}"] if new_tokens else []) + extra


class Timers:
    """Wall-clock seconds of each wrapped call, by name."""

    def __init__(self):
        self.calls: dict[str, list[float]] = defaultdict(list)

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        @functools.wraps(fn)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.calls[name].append(time.perf_counter() - t0)

        setattr(obj, attr, timed)  # an instance attribute: found before the class's method


@contextmanager
def gpu_steps_recorded():
    """Yields a list of each (busy s, idle s or None) the engine accounts for an async decode step
    while the block runs (StepStats sums them; generate() makes a new StepStats, so the class's
    method is wrapped, and restored after)."""
    steps, add = [], StepStats.add_gpu_decode

    def recorded(self, busy: float, idle) -> None:
        steps.append((busy, idle))
        add(self, busy, idle)

    StepStats.add_gpu_decode = recorded
    try:
        yield steps
    finally:
        StepStats.add_gpu_decode = add


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else 0.0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="e2b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="JSON file for every number")
    ap.add_argument("--profile-prefill", action="store_true",
                    help="after the timed round, the kernels of the first prefill step of the same prompts")
    args, extra = ap.parse_known_args(argv)
    cfg = compose(preset_overrides(args.model, args.batch, args.new_tokens, args.device, extra))
    engine = build_engine(cfg, pool_demand(cfg.workload))
    work = synthetic(cfg.workload, engine.spec.vocab_size)
    prompts, params = work.prompts[:args.batch], work.params[:args.batch]
    engine.generate(prompts, params)  # untimed: whatever the first round of this shape builds
    engine.reset_prefix_cache()

    runner, sched = engine.runner, engine.scheduler
    timers = Timers()
    cuda = args.device.startswith("cuda")
    timers.wrap(sched, "grow_for_decode", "grow pages")
    timers.wrap(sched, "can_chain", "can chain")
    timers.wrap(runner, "fill_decode", "fill inputs + masks")
    timers.wrap(runner.masks, "fill_decode", "  of which masks")
    timers.wrap(runner, "collect", "wait + read tokens")
    timers.wrap(sched, "postprocess_launched", "postprocess")
    timers.wrap(runner, "launch_decode", "launch step (fill + replay)")
    timers.wrap(runner, "run", "synchronous steps (prefill)")
    timers.wrap(sched, "schedule", "schedule")
    if cuda:
        torch.cuda.synchronize()
    with gpu_steps_recorded() as gpu_steps:
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    steps, decode_s = engine.stats.decode_steps, engine.stats.decode_time  # this call's (reset per call)
    tokens = sum(int(p.max_new_tokens) for p in params)
    res = {"model": args.model, "batch": args.batch, "overrides": extra, "round_s": wall, "tok_s": tokens / wall,
           "decode_steps": steps, "decode_s": decode_s, "decode_step_ms": decode_s / max(steps, 1) * 1e3,
           "host_ms_per_call": {k: median_ms(v) for k, v in timers.calls.items()},
           "host_s_total": {k: sum(v) for k, v in timers.calls.items()},
           "calls": {k: len(v) for k, v in timers.calls.items()}}
    if gpu_steps:
        busy = [b * 1e3 for b, _ in gpu_steps]
        gaps = [i * 1e3 for _, i in gpu_steps if i is not None]  # chained steps only
        res.update({"gpu_step_ms_median": statistics.median(busy),
                    "gpu_gap_ms_median": statistics.median(gaps) if gaps else 0.0,
                    "gpu_gap_ms_p90": sorted(gaps)[int(0.9 * (len(gaps) - 1))] if gaps else 0.0,
                    "gpu_busy_s": sum(busy) / 1e3, "gpu_gaps_s": sum(gaps) / 1e3})
    print(f"{args.model} batch {args.batch}: round {wall:.2f} s, {res['tok_s']:,.0f} tok/s; {steps} decode steps, "
          f"{res['decode_step_ms']:.2f} ms a step (engine's clock), prefill+other {wall - decode_s:.2f} s")
    if gpu_steps:
        print(f"GPU per decode step: busy {res['gpu_step_ms_median']:.2f} ms (median), gap to the next "
              f"{res['gpu_gap_ms_median']:.2f} ms (median; p90 {res['gpu_gap_ms_p90']:.2f}); decode busy "
              f"{res['gpu_busy_s']:.2f} s, idle between steps {res['gpu_gaps_s']:.2f} s")
    for k, v in res["host_ms_per_call"].items():
        print(f"  host {k:30s} {v:8.3f} ms a call (median), {res['calls'][k]:5d} calls, "
              f"{res['host_s_total'][k]:7.3f} s in all")
    if args.profile_prefill:
        res["prefill_kernels"] = profile_first_prefill(engine, prompts, params, cuda)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return res


def profile_first_prefill(engine, prompts, params, cuda: bool) -> dict:
    """The kernels of one engine step with every prompt waiting (a prefill of up to
    engine.max_prefill_tokens tokens), after one such step untimed (it compiles); the requests are
    aborted after each step. An A/B of a kernel choice runs the script once per setting
    (kernels.prefill_full_blocks=false: the prefill masks without full blocks)."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for attempt in range(2):
        engine.reset_prefix_cache()  # the prompts were cached by the rounds before: prefill them again
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        sync()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            engine.step()
            sync()
        wall = time.perf_counter() - t0
        for i in ids:
            engine.abort(i)
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = sum(e.self_device_time_total for e in events) / 1e3
    attn = sum(e.self_device_time_total for e in events if "flex_attention" in e.key) / 1e3
    print(f"first prefill step: {wall * 1e3:.1f} ms wall (under the profiler), kernels {total:.1f} ms, of which "
          f"flex attention {attn:.1f} ms")
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=90))
    return {"wall_ms": wall * 1e3, "kernels_ms": total, "flex_ms": attn,
            "kernels": [{"name": e.key[:120], "ms": e.device_time_total / 1e3, "calls": e.count} for e in events[:30]]}


if __name__ == "__main__":
    main()
