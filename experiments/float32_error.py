"""How far float32 is from float64 on a model's geometry, for flexgemma and for transformers: the
first generated token's logprob of prompts of several lengths, each engine's float32 against
transformers in float64 on the same weights (random weights amplify rounding layer by layer, so
float32 parity with transformers is judged against transformers' own float32 error).

    python experiments/float32_error.py +model=e2b model.hf_config.vocab_size=32768 \
        model.hf_config.vocab_size_per_layer_input=32768 model.hf_config.intermediate_size=1024 \
        model.allow_large_cpu=true --lengths 7,130,600,1000
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexgemma import SamplingParams, build_engine, compose  # noqa: E402
from flexgemma.tasks.parity import last_logprobs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="7,130,600,1000", help="prompt lengths, comma-separated")
    args, overrides = ap.parse_known_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    engine = build_engine(compose(["device=cpu", "model.dtype=float32", f"engine.max_model_len={max(lengths) + 8}",
                                   "kv.cpu_pages=64", *overrides]))
    vocab = engine.spec.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [[2] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in lengths]
    outs = [engine.generate([p], SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))[0]
            for p in prompts]
    model64 = copy.deepcopy(engine.model).double()
    print("| prompt tokens | flexgemma f32 - f64 | transformers f32 - f64 | flexgemma - transformers (f32) |")
    print("|---:|---:|---:|---:|")
    for p, o in zip(prompts, outs):
        t = o.token_ids[0]
        lp32, lp64 = last_logprobs(engine.model, p)[t].item(), last_logprobs(model64, p)[t].item()
        print(f"| {len(p)} | {abs(o.logprobs[0] - lp64):.2e} | {abs(lp32 - lp64):.2e} | {abs(o.logprobs[0] - lp32):.2e} |",
              flush=True)


if __name__ == "__main__":
    main()
