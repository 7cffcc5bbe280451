"""How a workload packs into prefill steps: the scheduler alone (a tiny model whose run is stubbed),
for given prompt lengths, n copies each, page size and prefill budget. Prints each prefill step's
tokens, routed MoE entries (x top-8) and which prompts' first copies and other copies it holds.

    python experiments/replay_schedule.py --lengths 2027,2025,2036,1413 --n 8 --max-prefill-tokens 8192

Used to see which copies of a GRPO group computed their last page in a small step (the MoE layers
take the Triton expert kernel up to 4,096 routed entries, torch's grouped GEMM above).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexgemma import SamplingParams, build_engine, compose  # noqa: E402
from flexgemma.model.moe_kernel import KERNEL_MAX_ENTRIES  # noqa: E402


def main(argv=None) -> list:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", required=True, help="comma-separated prompt lengths")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--max-batch-size", type=int, default=None, help="default: every sequence at once")
    ap.add_argument("--prefix-cache", default="true")
    ap.add_argument("--top-k", type=int, default=8, help="experts a token routes to (26B-A4B: 8)")
    args = ap.parse_args(argv)
    lens = [int(x) for x in args.lengths.split(",")]
    longest, seqs = max(lens) + 2, len(lens) * args.n
    engine = build_engine(compose([
        "+model=tiny", "device=cpu", f"kv.page_size={args.page_size}", f"engine.max_model_len={longest}",
        f"model.hf_config.max_position_embeddings={longest}", f"kv.cpu_pages={seqs * (longest // args.page_size + 2)}",
        f"engine.max_prefill_tokens={args.max_prefill_tokens}", f"engine.max_batch_size={args.max_batch_size or seqs}",
        f"kv.prefix_cache={args.prefix_cache}",
    ]))
    steps = []

    def run(plan):  # the scheduler's plans only: no model, one token for each sampling row
        if plan.kind == "prefill":
            steps.append([(s.index // args.n, s.index % args.n, k) for s, k in zip(plan.seqs, plan.chunk_lens)])
        rows = sum(plan.samples(i) for i in range(len(plan.seqs)))
        return [5] * rows, [0.0] * rows, None  # tokens, logprobs, no routed experts

    engine.runner.run = run
    rng = random.Random(0)
    prompts = [p for L in lens for p in [[2] + [rng.randrange(3, 500) for _ in range(L - 1)]] * args.n]
    engine.generate(prompts, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
    for i, step in enumerate(steps):
        tokens = sum(k for *_, k in step)
        firsts = [(p, k) for p, c, k in step if c == 0]
        copies = sorted({p for p, c, _ in step if c})
        path = "Triton expert kernels" if tokens * args.top_k <= KERNEL_MAX_ENTRIES else "torch's grouped GEMM"
        print(f"prefill step {i}: {tokens} tokens ({tokens * args.top_k} routed entries: {path}); "
              f"first copies (prompt, tokens) {firsts}; other copies of prompts {copies}")
    return steps


if __name__ == "__main__":
    main()
