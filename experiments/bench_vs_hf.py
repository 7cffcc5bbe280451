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
from flexgemma.tasks.common import weight_bytes_per_decode_step  # noqa: E402
from flexgemma.tracking import environment  # noqa: E402
from flexgemma.workload import synthetic  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-rounds", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", default=None)
    args, overrides = ap.parse_known_args()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    cfg = compose(overrides)
    engine = build_engine(cfg)
    build_s = time.perf_counter() - t0
    w = cfg.workload
    work = synthetic(w, engine.spec.vocab_size)
    for _ in range(int(w.warmup_rounds)):
        engine.generate(work.prompts, work.params)
    sync()
    rounds = []
    for _ in range(int(w.rounds)):
        t1 = time.perf_counter()
        outs = engine.generate(work.prompts, work.params)
        wall = time.perf_counter() - t1
        st = engine.stats
        rounds.append({
            "wall": wall, "tokens": sum(len(o.token_ids) for o in outs), "decode_steps": st.decode_steps,
            "decode_time": st.decode_time, "prefill_time": st.prefill_time, "prefill_tokens": st.prefill_tokens,
        })
    med = lambda key: statistics.median(r[key] for r in rounds)  # noqa: E731
    tok_s = [r["tokens"] / r["wall"] for r in rounds]
    step_ms = med("decode_time") / med("decode_steps") * 1e3
    esize = next(engine.model.parameters()).element_size()
    contexts = [len(p) + w.max_new_tokens // 2 for p in work.prompts]
    wbytes = weight_bytes_per_decode_step(engine.model)
    kvbytes = kv_bytes_per_step(engine.spec, contexts, esize, cfg.kv.page_size)
    res = {
        "model": cfg.model.name,
        "overrides": overrides,
        "build_seconds": build_s,
        "engine": engine.info,
        "flexgemma/tok_s_rounds": tok_s,
        "flexgemma/tok_s_median": statistics.median(tok_s),
        "flexgemma/decode_step_ms_median": step_ms,
        "flexgemma/prefill_seconds_median": med("prefill_time"),
        "flexgemma/peak_allocated_gb": peak(),
        "flexgemma/peak_reserved_gb": peak("reserved"),
        "roofline/weight_gb_per_step": wbytes / GB,
        "roofline/kv_gb_per_step_mean": kvbytes / GB,
        "roofline/achieved_tb_s": (wbytes + kvbytes) / (step_ms / 1e3) / 1e12,
        "roofline/cap_tok_s_at_4.3TBs": len(work.prompts) * 4.3e12 / (wbytes + kvbytes),
    }
    if engine.runner.graphs is not None:
        res.update(engine.runner.graphs.metrics())
    if engine.compile_counter is not None:
        res["compile/graphs"] = engine.compile_counter.count
    res.update(environment())
    if not args.no_hf:
        engine.runner.graphs = None  # free nothing, but make sure only HF runs now
        res.update(hf_generate(engine.model, work.prompts, int(w.max_new_tokens), args.hf_rounds))
        res["speedup_vs_hf"] = res["flexgemma/tok_s_median"] / res["hf/tok_s_median"]
    print(json.dumps(res, indent=1, default=str))
    keys = ["build_seconds", "flexgemma/tok_s_median", "flexgemma/decode_step_ms_median", "flexgemma/peak_allocated_gb",
            "roofline/achieved_tb_s", "roofline/cap_tok_s_at_4.3TBs", "hf/tok_s_median", "hf/peak_allocated_gb",
            "speedup_vs_hf", "cudagraph/capture_seconds", "compile/graphs"]
    print("\n".join(f"{k:34s} {res[k]:.3f}" if isinstance(res.get(k), float) else f"{k:34s} {res.get(k)}"
                    for k in keys))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
