"""Where a decode step's time goes: host preparation vs GPU replay, the top kernels, and flex
decode kernel options timed alone on the real paged layout.

    python experiments/profile_decode.py +model=e2b +experiment=speed_e2b cudagraph.buckets=[64] \
        --batch 64 --context 544 --sweep

Sequences are placed in the real pool (pages from the allocator) with `--context` tokens each;
the KV contents are whatever the pool holds, which does not change the timing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexgemma import SamplingParams, build_engine, compose  # noqa: E402
from flexgemma.engine.sequence import Sequence, Status  # noqa: E402
from flexgemma.model.attention import _KERNEL_KEYS  # noqa: E402
from flexgemma.tasks.common import cuda_time_ms, graph_time_ms  # noqa: E402


def place_batch(engine, batch: int, context: int, temperature: float = 0.0) -> list[Sequence]:
    # distinct random tokens per row: one token id for every row would route every row of an MoE
    # layer to the same 8 experts (a profile of 8 experts read instead of ~52 at batch 8)
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(batch):
        tokens = torch.randint(3, engine.spec.vocab_size, (context,), generator=gen).tolist()
        s = Sequence(10_000 + i, i, tokens, SamplingParams(max_new_tokens=8, temperature=temperature), seed=i)
        if not engine.scheduler.grow(s, context + 1):
            free = {g.name: g.allocator.num_free for g in engine.scheduler.cache.page_groups}
            raise SystemExit(f"row {i}: no pages for {context + 1} tokens (free: {free}); lower --batch/--context")
        s.num_computed = context - 1
        engine.scheduler.reclaim(s)  # the sliding group holds only the window, as in a real decode
        s.status = Status.RUNNING
        seqs.append(s)
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=544)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the rows' sampling temperature: 0 replays the all-greedy graph, > 0 the sampling one (the "
                         "noise over the vocabulary, as a GRPO rollout at temperature 1)")
    ap.add_argument("--sweep", action="store_true", help="time flex decode kernel options per layer type")
    ap.add_argument("--prefill-sweep", action="store_true",
                    help="time flex prefill kernel options per layer type on one packed prefill of the workload's "
                         "prompts (engine.max_prefill_tokens of them), with the masks' full blocks")
    ap.add_argument("--prefill-page-checks", action="store_true",
                    help="time compiled flex prefill per layer type on one packed prefill of the workload's prompts "
                         "with each kernels.prefill_page_check (the engine's tiles), and compare their outputs")
    ap.add_argument("--out", default=None)
    args, overrides = ap.parse_known_args()
    engine = build_engine(compose(overrides))
    runner = engine.runner
    seqs = place_batch(engine, args.batch, args.context, args.temperature)
    rows = runner.graphs.bucket_for(len(seqs)) if runner.graphs else len(seqs)
    greedy = args.temperature == 0
    res: dict = {"batch": args.batch, "context": args.context, "temperature": args.temperature, "overrides": overrides}

    t0 = time.perf_counter()
    for _ in range(50):
        runner.fill_decode(seqs, rows)
    torch.cuda.synchronize()
    res["host_fill_ms"] = (time.perf_counter() - t0) / 50 * 1e3
    t0 = time.perf_counter()
    for _ in range(50):
        engine.scheduler.schedule()
    res["host_schedule_ms"] = (time.perf_counter() - t0) / 50 * 1e3

    if runner.graphs:
        res["replay_ms"] = cuda_time_ms(lambda: runner.graphs.graphs[rows, greedy].replay())
    res["step_fn_ms"] = cuda_time_ms(lambda: runner.decode_step(rows, greedy), iters=20)
    # a whole engine step as generate() runs it: schedule + fill + replay + sync
    plan = engine.scheduler.schedule()
    t0 = time.perf_counter()
    for _ in range(30):
        runner.run(plan)
    res["engine_step_ms"] = (time.perf_counter() - t0) / 30 * 1e3

    from torch.profiler import ProfilerActivity, profile

    runner.fill_decode(seqs, rows)  # runner.run above left the graph's inputs as its own plan set them
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            if runner.graphs:
                runner.graphs.graphs[rows, greedy].replay()
            else:
                runner.decode_step(rows, greedy)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)
    print(table)
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    res["top_kernels"] = [
        {"name": e.key[:120], "ms_per_step": e.device_time_total / 1e3 / 5, "calls_per_step": e.count / 5}
        for e in events[:30]
    ]

    if args.sweep:
        res["flex_sweep"] = sweep_flex(engine, seqs, rows)
    if args.prefill_sweep or args.prefill_page_checks:
        for s in seqs:
            engine.scheduler._release_all(s)
    if args.prefill_sweep:
        res["prefill_sweep"] = sweep_prefill(engine, compose(overrides))
    if args.prefill_page_checks:
        res["prefill_page_checks"] = time_page_checks(engine, compose(overrides))
    print(json.dumps({k: v for k, v in res.items() if k != "top_kernels"}, indent=1, default=str))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))


def time_options(phase: str, layer_type: str, head_dim: int, own, grid: list, time_one) -> list[dict]:
    """Compiles flex_attention for each kernel option set of `grid` and times it with
    time_one(fn, options); a row per set (its ms, or why it did not compile or fit; `engine_default`
    marks `own`, the layer's options in the engine). Prints the engine's and the best."""
    from torch.nn.attention.flex_attention import flex_attention

    rows = []
    for opts in grid:
        fn = torch.compile(flex_attention, dynamic=False)
        row = {"layer_type": layer_type, "head_dim": head_dim, "options": opts}
        try:
            row.update(ms=time_one(fn, opts), engine_default=opts is own)
        except Exception as e:  # noqa: BLE001 - record which options do not compile or fit
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
        torch._dynamo.reset()
    timed = [r for r in rows if "ms" in r]
    best = min(timed, key=lambda r: r["ms"])
    mine = next((r for r in timed if r.get("engine_default")), None)
    print(f"{phase} {layer_type}: engine's options {mine and round(mine['ms'], 4)} ms {own}; best "
          f"{best['ms']:.4f} ms {best['options']}")
    return rows


def sweep_flex(engine, seqs, rows) -> list[dict]:
    """Times compiled flex decode on each layer type's real pool and masks, per kernel option set
    (the engine's own options first)."""
    runner = engine.runner
    runner.fill_decode(seqs, rows)
    masks = runner.decode_masks(rows)
    out = []
    for layer_type in sorted(masks):
        spec = next(s for s in engine.spec.layers if s.layer_type == layer_type and s.writes_kv)
        k, v = engine.runner.cache.layer_kv(spec.index)
        q = torch.randn(rows, spec.num_heads, 1, spec.head_dim, device=k.device, dtype=k.dtype)
        own = runner.forward.attn[spec.index].options["decode"]
        # head_dim 512 keeps the config's BLOCK_M 16 (an override sets the tiles, warps and stages)
        ns, fixed = ((16, 32), {"BLOCK_M": 16}) if spec.head_dim >= 512 else ((32, 64), {})
        grid = [own] + [dict(fixed, BLOCK_N=bn, num_warps=w, num_stages=st)
                        for bn, w, st in itertools.product(ns, (4, 8), (1, 2, 3))]
        # in a graph: the kernel runs ~0.1 ms, shorter than the host's launch of a compiled call
        out += time_options("decode", layer_type, spec.head_dim, own, grid, lambda fn, opts: graph_time_ms(
            lambda: fn(q, k, v, block_mask=masks[layer_type], scale=1.0, enable_gqa=True, kernel_options=opts)))
    print("decode overrides:", " ".join(decode_overrides(out)))
    return out


def decode_overrides(sweep: list[dict], min_gain: float = 0.02) -> list[str]:
    """Hydra overrides that set each layer type's fastest decode options, where they beat the
    engine's own by more than min_gain (attn.decode for sliding layers, attn.decode.full_attention
    for the head_dim-512 ones)."""
    out, names = [], {v: k for k, v in _KERNEL_KEYS.items()}  # flex option -> config field
    for layer_type in sorted({r["layer_type"] for r in sweep}):
        timed = [r for r in sweep if r["layer_type"] == layer_type and "ms" in r]
        mine = next((r for r in timed if r.get("engine_default")), None)
        best = min(timed, key=lambda r: r["ms"], default=None)
        if best is None or mine is None or best["ms"] > mine["ms"] * (1 - min_gain):
            continue
        group = "attn.decode.full_attention" if best["head_dim"] >= 512 else "attn.decode"
        out += [f"{group}.{names[key]}={val}" for key, val in best["options"].items() if key in names]
    return out


def prefill_batch(engine, cfg) -> tuple[list[Sequence], list[int]]:
    """The workload's first prompts, up to engine.max_prefill_tokens tokens, each with pages for its
    prompt and nothing computed: one packed prefill chunk, as the engine's first step of a round."""
    from flexgemma.tasks.workload import synthetic

    work = synthetic(cfg.workload, engine.spec.vocab_size)
    seqs, lens, budget = [], [], int(cfg.engine.max_prefill_tokens)
    for i, p in enumerate(work.prompts):
        if sum(lens) + len(p) > budget:
            break
        s = Sequence(20_000 + i, i, list(p), SamplingParams(max_new_tokens=8, temperature=0.0), seed=i)
        if not engine.scheduler.grow(s, len(p)):
            break
        seqs.append(s)
        lens.append(len(p))
    return seqs, lens


def sweep_prefill(engine, cfg) -> list[dict]:
    """Times compiled flex prefill on each layer type's real pool and packed masks, per kernel
    option set (the engine's own options first)."""
    runner = engine.runner
    seqs, lens = prefill_batch(engine, cfg)
    padded = -(-sum(lens) // runner.q_block) * runner.q_block
    masks = runner.masks.prefill(seqs, lens, padded)
    print(f"prefill sweep: {len(seqs)} prompts, {sum(lens)} tokens (padded {padded})")
    out = []
    for layer_type in sorted(masks):
        spec = next(s for s in engine.spec.layers if s.layer_type == layer_type and s.writes_kv)
        k, v = runner.cache.layer_kv(spec.index)
        q = torch.randn(1, spec.num_heads, padded, spec.head_dim, device=k.device, dtype=k.dtype)
        own = runner.forward.attn[spec.index].options["prefill"]
        ms_ = (16, 32, 64) if spec.head_dim >= 512 else (64, 128)
        ns = (16, 32) if spec.head_dim >= 512 else (32, 64)
        grid = [own] + [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st)
                        for m, n, w, st in itertools.product(ms_, ns, (4, 8), (1, 2, 3))]
        out += time_options("prefill", layer_type, spec.head_dim, own, grid, lambda fn, opts: cuda_time_ms(
            lambda: fn(q, k, v, block_mask=masks[layer_type], scale=1.0, enable_gqa=True, kernel_options=opts),
            iters=10))
    return out


def time_page_checks(engine, cfg) -> list[dict]:
    """Compiled flex prefill on each layer type's real pool under the masks of each
    kernels.prefill_page_check (the engine's own tiles), the same queries for both: ms a call, and
    whether the outputs have the same bits (the two checks describe one mask)."""
    import copy

    from torch.nn.attention.flex_attention import flex_attention

    runner = engine.runner
    seqs, lens = prefill_batch(engine, cfg)
    padded = -(-sum(lens) // runner.q_block) * runner.q_block
    print(f"prefill page checks: {len(seqs)} prompts, {sum(lens)} tokens (padded {padded})")
    fn = torch.compile(flex_attention, dynamic=False)
    rows, outs = [], {}
    for check in ("table", "owner"):
        builder = copy.copy(runner.masks)
        builder.page_check = check
        masks = builder.prefill(seqs, lens, padded)
        for layer_type in sorted(masks):
            spec = next(s for s in engine.spec.layers if s.layer_type == layer_type and s.writes_kv)
            k, v = runner.cache.layer_kv(spec.index)
            gen = torch.Generator(device=k.device).manual_seed(spec.index)
            q = torch.randn(1, spec.num_heads, padded, spec.head_dim, device=k.device, dtype=k.dtype, generator=gen)
            opts = runner.forward.attn[spec.index].options["prefill"]
            call = lambda: fn(q, k, v, block_mask=masks[layer_type], scale=1.0, enable_gqa=True,  # noqa: E731
                              kernel_options=opts)
            outs[check, layer_type] = call()
            rows.append({"page_check": check, "layer_type": layer_type, "head_dim": spec.head_dim,
                         "mask_check": masks[layer_type].mask_mod.page_check,
                         "ms": cuda_time_ms(call, iters=10)})
    for layer_type in sorted({r["layer_type"] for r in rows}):
        same = torch.equal(outs["table", layer_type], outs["owner", layer_type])
        ms = {r["page_check"]: r["ms"] for r in rows if r["layer_type"] == layer_type}
        for r in rows:
            if r["layer_type"] == layer_type:
                r["bits_equal"] = same
        print(f"prefill {layer_type}: table {ms['table']:.3f} ms, owner {ms['owner']:.3f} ms, bits equal {same}")
    return rows


if __name__ == "__main__":
    main()
