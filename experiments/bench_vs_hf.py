"""flexgemma vs transformers `generate`, side by side in one process on one GPU.

Same weights (the engine's own Gemma4ForCausalLM), same prompts, same token budget, EOS ignored.
flexgemma: `workload.warmup_rounds` then `workload.rounds` timed rounds (median reported).
transformers: sdpa, bf16, batched with left padding, --hf-rounds timed rounds after a short warm-up.

    python experiments/bench_vs_hf.py +model=e2b +experiment=speed_e2b --hf-rounds 2 --out bench.json

Prints a table and writes every number as JSON (--out).
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

from flexgemma import build_engine, compose  # noqa: E402
from flexgemma.tasks.common import TimedRound, timed_rounds, weight_bytes_per_decode_step  # noqa: E402
from flexgemma.run.tracking import environment  # noqa: E402
from flexgemma.tasks.workload import synthetic  # noqa: E402

GB = 1e9
CUDA = torch.cuda.is_available()  # the numbers are GPU numbers; on the CPU the script only smoke-tests


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def peak(kind: str = "allocated") -> float:
    if not CUDA:
        return float("nan")
    return (torch.cuda.max_memory_allocated() if kind == "allocated" else torch.cuda.max_memory_reserved()) / GB


def kv_bytes_per_step(spec, contexts: list[int], element_size: int, page: int) -> float:
    """Bytes of K and V the attention of one decode step reads, over the pages it lists."""
    total = 0
    for s in spec.layers:
        per_token = 2 * s.num_kv_heads * s.head_dim * element_size
        for ctx in contexts:
            lo = 0 if s.window is None else max(0, ctx - s.window)
            total += (ctx // page - lo // page + 1) * page * per_token
    return total


@torch.inference_mode()
def hf_generate(model, prompts, max_new: int, rounds: int) -> dict:
    from transformers import GenerationConfig

    dev = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    gen = lambda n: GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=[],  # noqa: E731
                                     pad_token_id=0)
    model.generate(ids, attention_mask=mask, generation_config=gen(8))  # warm-up
    sync()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, generation_config=gen(max_new))
        sync()
        times.append(time.perf_counter() - t0)
    new_tokens = (out.shape[1] - width) * len(prompts)
    return {
        "hf/round_seconds": times,
        "hf/tok_s_median": new_tokens / statistics.median(times),
        "hf/peak_allocated_gb": peak(),
        "hf/generated_tokens": new_tokens,
    }


def engine_numbers(engine, cfg, prompts, rounds: list[TimedRound], prefix: str) -> dict:
    tok_s = [r.tok_s for r in rounds]
    step_ms = statistics.median(r.stats.decode_time for r in rounds) / statistics.median(r.stats.decode_steps for r in rounds) * 1e3
    esize = next(engine.model.parameters()).element_size()
    contexts = [len(p) + cfg.workload.max_new_tokens // 2 for p in prompts]
    wbytes = weight_bytes_per_decode_step(engine.model, len(prompts))  # MoE: the experts this batch routes to
    kvbytes = kv_bytes_per_step(engine.spec, contexts, esize, cfg.kv.page_size)
    return {
        f"{prefix}flexgemma/tok_s_rounds": tok_s,
        f"{prefix}flexgemma/tok_s_median": statistics.median(tok_s),
        f"{prefix}flexgemma/decode_step_ms_median": step_ms,
        f"{prefix}flexgemma/prefill_seconds_median": statistics.median(r.stats.prefill_time for r in rounds),
        f"{prefix}roofline/weight_gb_per_step": wbytes / GB,
        f"{prefix}roofline/kv_gb_per_step_mean": kvbytes / GB,
        f"{prefix}roofline/achieved_tb_s": (wbytes + kvbytes) / (step_ms / 1e3) / 1e12,
        f"{prefix}roofline/cap_tok_s_at_4.3TBs": len(prompts) * 4.3e12 / (wbytes + kvbytes),
    }


@torch.inference_mode()
def greedy_parity(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """flexgemma's greedy tokens against transformers `generate` (one prompt at a time, no padding) on
    the same weights: free-running agreement up to the first divergence, and teacher-forced top-1
    agreement (flexgemma's next token after each prefix of transformers' own continuation)."""
    from flexgemma import SamplingParams
    from flexgemma.tasks.parity import compare, first_divergence, hf_greedy

    greedy = lambda n: SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    ours = [o.token_ids for o in engine.generate(prompts, greedy(new_tokens))]
    ref = [hf_greedy(engine.model, p, new_tokens) for p in prompts]
    res = compare(ours, ref)
    prefixes = [p + r[:j] for p, r in zip(prompts, ref) for j in range(len(r))]
    forced = [o.token_ids[0] for o in engine.generate(prefixes, greedy(1))]
    wanted = [t for r in ref for t in r]
    res["parity/teacher_forced_top1_pct"] = 100.0 * sum(a == b for a, b in zip(forced, wanted)) / len(wanted)
    res["parity/first_divergence_per_prompt"] = [
        d if (d := first_divergence(x, y)) is not None else -1 for x, y in zip(ours, ref)]
    res["parity/new_tokens"] = new_tokens
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-rounds", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--batch-sizes", default=None,
                    help="comma list: time the engine at each batch size (the first N prompts of the workload, "
                         "which then needs workload.num_prompts >= the largest) in one build")
    ap.add_argument("--hf-batch-sizes", default=None, help="comma list: the batch sizes transformers runs "
                    "(default: the smallest of --batch-sizes)")
    ap.add_argument("--parity", type=int, default=0, metavar="N",
                    help="also compare greedy tokens with transformers on the first N prompts")
    ap.add_argument("--parity-tokens", type=int, default=32)
    ap.add_argument("--both-loops", action="store_true",
                    help="time each batch size again with the other decode loop (engine.async_decode flipped; the "
                         "same build); its numbers are prefixed sync/ or async/")
    ap.add_argument("--out", default=None)
    args, overrides = ap.parse_known_args()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    cfg = compose(overrides)
    engine = build_engine(cfg)
    build_s = time.perf_counter() - t0
    # the build's peak (weights, compile, capture) apart from the serving peak (prefill activations on
    # top of weights, pool and graphs): the two have different cures
    build_peak = peak()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    w = cfg.workload
    work = synthetic(w, engine.spec.vocab_size)
    sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else [len(work.prompts)]
    if max(sizes) > len(work.prompts):
        sys.exit(f"--batch-sizes {args.batch_sizes}: the workload has {len(work.prompts)} prompts; "
                 f"set workload.num_prompts={max(sizes)}")
    res = {"model": cfg.model.name, "overrides": overrides, "build_seconds": build_s, "engine": engine.info,
           "batch_sizes": sizes}
    loops = [bool(engine.async_decode)] + ([not engine.async_decode] if args.both_loops else [])
    for bs in sizes:
        for async_decode in loops:
            engine.async_decode = async_decode
            rounds = timed_rounds(engine, work.prompts[:bs], work.params[:bs], int(w.rounds), int(w.warmup_rounds))
            loop = "async" if async_decode else "sync"
            prefix = ("" if len(sizes) == 1 else f"bs{bs}/") + (f"{loop}/" if async_decode != loops[0] else "")
            res.update(engine_numbers(engine, cfg, work.prompts[:bs], rounds, prefix))
            print(f"bs {bs:3d} {loop:5s}: {res[prefix + 'flexgemma/tok_s_median']:9.1f} tok/s, "
                  f"step {res[prefix + 'flexgemma/decode_step_ms_median']:.2f} ms, "
                  f"roofline cap {res[prefix + 'roofline/cap_tok_s_at_4.3TBs']:.0f} tok/s", flush=True)
    engine.async_decode = loops[0]
    res["flexgemma/peak_build_allocated_gb"] = build_peak
    res["flexgemma/peak_serving_allocated_gb"] = peak()
    res["flexgemma/peak_allocated_gb"] = max(build_peak, peak())
    res["flexgemma/peak_reserved_gb"] = peak("reserved")
    if len(sizes) > 1:
        curve = [res[f"bs{b}/flexgemma/tok_s_median"] for b in sizes]
        res["flexgemma/monotone_in_batch"] = all(b >= a for a, b in zip(curve, curve[1:]))
    if engine.runner.graphs is not None:
        res.update(engine.runner.graphs.metrics())
    if engine.compile_counter is not None:
        res["compile/graphs"] = engine.compile_counter.count
    res.update(environment())
    if args.parity:
        res.update(greedy_parity(engine, work.prompts[:args.parity], args.parity_tokens))
        print(f"parity: {res['parity/token_match_pct']:.1f}% free-running, teacher-forced top-1 "
              f"{res['parity/teacher_forced_top1_pct']:.1f}%, first divergence per prompt "
              f"{res['parity/first_divergence_per_prompt']}", flush=True)
    if not args.no_hf:
        engine.runner.graphs = None  # free nothing, but make sure only HF runs now
        hf_sizes = [int(b) for b in args.hf_batch_sizes.split(",")] if args.hf_batch_sizes else [min(sizes)]
        for bs in hf_sizes:
            prefix = "" if len(sizes) == 1 else f"bs{bs}/"
            hf = hf_generate(engine.model, work.prompts[:bs], int(w.max_new_tokens), args.hf_rounds)
            res.update({prefix + k: v for k, v in hf.items()})
            if prefix + "flexgemma/tok_s_median" in res:
                res[prefix + "speedup_vs_hf"] = res[prefix + "flexgemma/tok_s_median"] / hf["hf/tok_s_median"]
    print(json.dumps(res, indent=1, default=str))
    keys = ["build_seconds", "flexgemma/peak_allocated_gb", "flexgemma/peak_build_allocated_gb",
            "flexgemma/peak_serving_allocated_gb", "cudagraph/capture_seconds", "compile/graphs"]
    per_bs = ["flexgemma/tok_s_median", "flexgemma/decode_step_ms_median", "roofline/achieved_tb_s",
              "roofline/cap_tok_s_at_4.3TBs", "hf/tok_s_median", "hf/peak_allocated_gb", "speedup_vs_hf"]
    keys += per_bs if len(sizes) == 1 else [f"bs{b}/{k}" for b in sizes for k in per_bs]
    print("\n".join(f"{k:40s} {res[k]:.3f}" if isinstance(res.get(k), float) else f"{k:40s} {res.get(k)}"
                    for k in keys if k in res or not k.startswith("bs")))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
