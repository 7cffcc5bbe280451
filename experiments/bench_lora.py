"""LoRA cost on the speed workload: throughput with a merged adapter vs without, refresh time of all
adapters, and peak memory, in one process on one GPU.

    python experiments/bench_lora.py +model=e2b +experiment=speed_e2b lora=r32 --out bench_lora.json
    python experiments/bench_lora.py +model=26b_a4b +experiment=speed_e2b lora=r32 lora.pristine_on_cpu=true

The same overrides build two engines one after the other: first with lora=none (the baseline),
then as given (lora=r32 when no lora= is given). Each runs `workload.warmup_rounds` then
`workload.rounds` timed rounds (median tok/s). The LoRA engine then takes --refresh-iters
update_lora calls with perturbed adapters (prepared on the GPU beforehand, as a trainer on the
same GPU would send them) and times each, synchronised. Targets (issue 5): E2B bf16 + r32 keeps
>= 95% of the baseline throughput; a refresh of all adapters takes < 50 ms.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexgemma import build_engine, compose  # noqa: E402
from flexgemma.tasks.common import timed_rounds  # noqa: E402
from flexgemma.tasks.drift import perturbed  # noqa: E402
from flexgemma.run.tracking import environment  # noqa: E402
from flexgemma.tasks.workload import synthetic  # noqa: E402

GB = 1e9


def throughput(engine, work, w) -> dict:
    rounds = timed_rounds(engine, work.prompts, work.params, int(w.rounds), int(w.warmup_rounds))
    return {
        "tok_s_rounds": [r.tok_s for r in rounds],
        "tok_s_median": statistics.median(r.tok_s for r in rounds),
        "decode_step_ms_median": statistics.median(r.decode_step_ms for r in rounds),
        "tokens": rounds[0].token_ids,
    }


def run_engine(overrides: list[str]) -> tuple[object, dict, object]:
    torch._dynamo.reset()  # compiled steps of an earlier engine must not keep its weights alive
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    cfg = compose(overrides)
    engine = build_engine(cfg)
    res = {"build_seconds": time.perf_counter() - t0, "engine": dict(engine.info),
           "weights_allocated_gb": torch.cuda.memory_allocated() / GB}
    # progress as it goes: a run cut short by a time limit still says how far it got
    print(f"built {' '.join(overrides)} in {res['build_seconds']:.1f} s "
          f"(compile + capture {engine.info.get('compile_capture_seconds', 0):.1f} s)", flush=True)
    work = synthetic(cfg.workload, engine.spec.vocab_size)
    res.update(throughput(engine, work, cfg.workload))
    print(f"  tok/s by round {[round(x) for x in res['tok_s_rounds']]}, decode step "
          f"{res['decode_step_ms_median']:.2f} ms", flush=True)
    res["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / GB
    res["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / GB
    return engine, res, work


def refresh_times(engine, iters: int, noise: float) -> dict:
    lora = engine.lora
    original = lora.state_dict()  # on the GPU, like a co-located trainer's adapter
    states = [perturbed(original, noise, seed=i + 1) for i in range(iters)]
    reports = [engine.update_lora(s) for s in states]
    merge_only = [lora.refresh() for _ in range(iters)]
    engine.update_lora(original)
    ms = [r["refresh_ms"] for r in reports]
    return {
        "refresh_ms_all": ms,
        "refresh_ms_median": statistics.median(ms),
        "refresh_ms_max": max(ms),
        "copy_ms_median": statistics.median(r["copy_ms"] for r in reports),
        "merge_ms_median": statistics.median(r["merge_ms"] for r in reports),
        "merge_only_ms_median": statistics.median(merge_only),
        "adapter_tensors": int(reports[0]["tensors"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--refresh-iters", type=int, default=20)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--skip-base", action="store_true", help="only the LoRA engine")
    ap.add_argument("--out", default=None)
    args, overrides = ap.parse_known_args()
    if not torch.cuda.is_available():
        sys.exit("bench_lora.py measures GPU throughput: no CUDA device")
    lora_overrides = overrides if any(o.startswith("lora=") for o in overrides) else [*overrides, "lora=r32"]
    base_overrides = [o for o in overrides if not o.startswith("lora")] + ["lora=none"]

    res: dict = {"overrides": lora_overrides}
    if not args.skip_base:
        engine, base, _ = run_engine(base_overrides)
        res["base"] = {k: v for k, v in base.items() if k != "tokens"}
        del engine
    engine, lora, work = run_engine(lora_overrides)
    res["lora"] = {k: v for k, v in lora.items() if k != "tokens"}
    res["lora"].update(refresh_times(engine, args.refresh_iters, args.noise))
    # the adapter restored after the refreshes: greedy tokens as before them
    restored = [o.token_ids for o in engine.generate(work.prompts, work.params)]
    res["lora"]["restored_tokens_identical"] = restored == lora["tokens"]
    if "base" in res:
        res["lora_changes_tokens"] = base["tokens"] != lora["tokens"]
        res["throughput_ratio"] = res["lora"]["tok_s_median"] / res["base"]["tok_s_median"]
        res["target/throughput_ge_95pct"] = res["throughput_ratio"] >= 0.95
    res["target/refresh_lt_50ms"] = res["lora"]["refresh_ms_median"] < 50.0
    res.update(environment())
    print(json.dumps(res, indent=1, default=str))
    rows = [
        ("base tok/s", res.get("base", {}).get("tok_s_median")),
        ("lora tok/s", res["lora"]["tok_s_median"]),
        ("throughput ratio", res.get("throughput_ratio")),
        ("refresh ms median / max", f"{res['lora']['refresh_ms_median']:.2f} / {res['lora']['refresh_ms_max']:.2f}"),
        ("  copy / merge ms", f"{res['lora']['copy_ms_median']:.2f} / {res['lora']['merge_ms_median']:.2f}"),
        ("base peak GB", res.get("base", {}).get("peak_allocated_gb")),
        ("lora peak GB", res["lora"]["peak_allocated_gb"]),
        ("pristine GB", res["lora"]["engine"].get("lora_pristine_bytes", 0) / GB),
        ("restored tokens identical", res["lora"]["restored_tokens_identical"]),
    ]
    print("\n".join(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}" for k, v in rows))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
