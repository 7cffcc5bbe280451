"""One variant over several batch sizes in ONE process: one build at engine.max_batch_size = the
largest batch (cudagraph=auto ladder), then for each batch size the first N prompts of the RL
workload (prompts of 64-512 tokens, EOS ignored): warm-up rounds, then >= 3 timed rounds.

    python experiments/bench_batches.py --model e2b --batch-sizes 64,128,256,512 --out results/batches
    python experiments/bench_batches.py --model 26b_a4b --batch-sizes 8,64,128 quant=bnb4   # overrides pass through
    python experiments/bench_batches.py --model tiny --device cpu --batch-sizes 2,4 --new-tokens 4   # smoke test

The preset +experiment=rl_batch_MODEL sets the workload where one exists (e2b, e4b, 26b_a4b, 31b);
other models run workload=rollout64. Writes a markdown table (for experiments/RESULTS.md) and every
number as JSON: tok/s (median of the timed rounds), the first round's speed over the median's, the
decode step, the prefill seconds, peak memory, and the share of the bandwidth limit: bytes one
decode step reads (weights, MoE experts as routed at that batch, + the KV of the median context)
over the GPU's peak bandwidth (H200: 4.8 TB/s) give a step time and so a tok/s no engine can beat at
that batch.
--results experiments/RESULTS.md appends the table as a lab-history entry (date, command, hardware,
versions, commit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexgemma import build_engine, compose  # noqa: E402
from flexgemma.compose import conf_dir  # noqa: E402
from flexgemma.tasks.common import decode_kv_bytes, timed_rounds, weight_bytes_per_decode_step  # noqa: E402
from flexgemma.tracking import environment  # noqa: E402
from flexgemma.workload import pool_demand, synthetic  # noqa: E402

GB = 1e9
COLUMNS = ["batch", "tok/s", "first/median", "step ms", "prefill s", "GPU idle %", "peak GB", "limit tok/s",
           "% of limit", "compiled in rounds"]


def overrides_for(args, extra: list[str]) -> list[str]:
    biggest = max(args.batch_sizes)
    preset = f"rl_batch_{args.model}"
    workload = [f"+experiment={preset}"] if (conf_dir() / "experiment" / f"{preset}.yaml").is_file() \
        else ["workload=rollout64"]
    out = [f"+model={args.model}", *workload, f"workload.num_prompts={biggest}", f"engine.max_batch_size={biggest}",
           f"workload.rounds={args.rounds}", f"device={args.device}"]
    if args.new_tokens:
        out.append(f"workload.max_new_tokens={args.new_tokens}")
    return out + extra  # the caller's overrides last: they win


def measure(engine, prompts, params, warmup: int, rounds: int, peak_tb_s: float, device: str) -> dict:
    """Warm-up rounds, then timed rounds of one batch; the row of the table (and more) as a dict."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # this batch size's own rounds (its warm-up has the same peak)
    timed = timed_rounds(engine, prompts, params, warmup, rounds)
    walls, tok_s = [r.wall for r in timed], [r.tok_s for r in timed]
    steps, compiled = [(r.decode_time, r.decode_steps) for r in timed], sum(r.compiled for r in timed)
    # the last round's requests, as decode_kv_bytes reads them
    outs = [SimpleNamespace(prompt_token_ids=p, token_ids=t) for p, t in zip(prompts, timed[-1].token_ids)]
    bs = len(prompts)
    step_s = statistics.median(t / max(n, 1) for t, n in steps)
    elem = engine.model.model.embed_tokens.weight.element_size()
    w_bytes = weight_bytes_per_decode_step(engine.model, bs)  # MoE: the experts this batch routes to
    kv_bytes = decode_kv_bytes(engine.spec, outs, elem) / max(timed[-1].decode_steps, 1)  # per step, the round's mean
    step_bytes = w_bytes + kv_bytes
    limit = bs * peak_tb_s * 1e12 / step_bytes  # tok/s if a decode step only read its bytes at peak bandwidth
    med = statistics.median(tok_s)
    idle = [r.gpu_idle_pct for r in timed if r.gpu_idle_pct is not None]
    prefill_s = statistics.median(r.prefill_time for r in timed)  # the part of a round decode steps do not explain
    return {
        "batch": bs, "tok_s_rounds": tok_s, "tok_s_median": med, "first_round_ratio": tok_s[0] / med,
        "first_round_within_5pct": tok_s[0] >= 0.95 * med, "decode_step_ms": step_s * 1e3,
        "prefill_seconds": prefill_s, "prefill_tok_s": timed[-1].prefill_tokens / prefill_s if prefill_s else None,
        "decode_steps": timed[-1].decode_steps,
        "gpu_idle_pct": statistics.median(idle) if idle else None,  # between chained decode steps (host-bound)
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / GB if cuda else None,
        "weight_gb_per_step": w_bytes / GB, "kv_gb_per_step": kv_bytes / GB,
        "decode_tb_s": step_bytes / step_s / 1e12 if step_s else None,
        "limit_tok_s": limit, "pct_of_limit": 100.0 * med / limit, "compiled_in_rounds": compiled,
        "round_seconds": walls,
    }


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}f}"
    return str(v)


def markdown(res: dict) -> str:
    info = res["engine"]
    frac = info.get("quant/fraction_4bit", 0.0)
    quant = f", {frac:.0%} of the weights 4-bit ({info.get('linear4bit_kernel', '?')} projections)" if frac else ""
    head = (f"{res['model']} ({info.get('weights', '?')}, {info.get('dtype', '?')}{quant}), one build at "
            f"max_batch_size {max(res['batch_sizes'])}: buckets {info.get('cudagraph_buckets')}, capture {fmt(info.get('capture_seconds'))} s, "
            f"graph pool {fmt(info.get('graph_pool_gib'))} GiB, warm-up {fmt(info.get('warmup_seconds'))} s, build "
            f"{fmt(res['build_seconds'])} s; KV {info.get('kv_bytes_per_token', 0) / 1024:.1f} KiB a token "
            f"({info.get('kv_bytes_per_token_full_layers', 0) / 1024:.1f} KiB past the sliding window). "
            f"Limit: bytes per decode step / {res['peak_tb_s']} TB/s.\n\n")
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    for r in res["rows"]:
        rows.append("| " + " | ".join([str(r["batch"]), fmt(r["tok_s_median"], 1), fmt(r["first_round_ratio"], 3),
                                       fmt(r["decode_step_ms"]), fmt(r["prefill_seconds"]), fmt(r["gpu_idle_pct"], 1),
                                       fmt(r["peak_allocated_gb"]), fmt(r["limit_tok_s"], 0),
                                       fmt(r["pct_of_limit"], 1), str(r["compiled_in_rounds"])]) + " |")
    return head + "\n".join(rows) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="e2b")
    ap.add_argument("--batch-sizes", required=True, type=lambda s: sorted({int(b) for b in s.split(",")}))
    ap.add_argument("--new-tokens", type=int, default=None, help="workload.max_new_tokens (default: the preset's)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per batch size (median reported)")
    ap.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds per batch size first")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peak-tb-s", type=float, default=4.8, help="the GPU's peak memory bandwidth (H200: 4.8)")
    ap.add_argument("--out", default=None, help="folder for bench_batches_MODEL.md and .json")
    ap.add_argument("--results", default=None, help="also append the table, with date, command, hardware, versions "
                                                    "and commit, to this markdown file (experiments/RESULTS.md)")
    args, extra = ap.parse_known_args(argv)
    overrides = overrides_for(args, extra)
    cfg = compose(overrides)
    device = str(getattr(cfg.device, "value", cfg.device))  # an enum in the typed config ("Device.cuda" as str)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = build_engine(cfg, pool_demand(cfg.workload))
    build_s = time.perf_counter() - t0
    work = synthetic(cfg.workload, engine.spec.vocab_size)
    res = {"model": args.model, "overrides": overrides,
           "batch_sizes": args.batch_sizes, "peak_tb_s": args.peak_tb_s,
           "build_seconds": build_s, "engine": engine.info, "rows": []}
    for bs in args.batch_sizes:
        row = measure(engine, work.prompts[:bs], work.params[:bs], args.warmup_rounds, int(cfg.workload.rounds),
                      args.peak_tb_s, device)
        res["rows"].append(row)
        print(f"bs {bs:4d}: {row['tok_s_median']:10.1f} tok/s, first/median {row['first_round_ratio']:.3f}, "
              f"step {row['decode_step_ms']:.2f} ms, prefill {row['prefill_seconds']:.2f} s, "
              f"{row['pct_of_limit']:.1f}% of the bandwidth limit", flush=True)
    res["environment"] = environment()
    table = markdown(res)
    print(table, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"bench_batches_{args.model}.md").write_text(table)
        (out / f"bench_batches_{args.model}.json").write_text(json.dumps(res, indent=1, default=str))
    if args.results:
        append_to_results(Path(args.results), res, table, argv if argv is not None else sys.argv[1:])
    return res


def append_to_results(path: Path, res: dict, table: str, argv: list) -> None:
    """The table as a lab-history entry at the end of `path` (experiments/RESULTS.md): date, the exact
    command, hardware, versions and commit, then the table."""
    env = res["environment"]
    hardware = env["env/gpu"] if env.get("env/gpu") not in (None, "none") else env.get("env/cpu", "?")
    versions = ", ".join(f"{k.split('/', 1)[1]} {env[k]}" for k in ("env/torch", "env/triton", "env/transformers")
                         if env.get(k))
    entry = (f"\n### bench_batches: {res['model']}, batches {', '.join(map(str, res['batch_sizes']))} "
             f"({time.strftime('%Y-%m-%d')})\n\n{hardware}; {versions}; "
             f"commit {env.get('env/git_sha', '?')}.\n\n"
             f"    python experiments/bench_batches.py {' '.join(argv)}\n\n{table}")
    with path.open("a") as f:
        f.write(entry)


if __name__ == "__main__":
    main()
