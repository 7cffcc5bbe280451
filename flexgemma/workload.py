"""Workloads: the prompts (and sampling) a task runs through the engine."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flexgemma.engine.sequence import SamplingParams

FIRST_ORDINARY_TOKEN = 3  # 0 pad, 1 eos, 2 bos in every Gemma-4 vocabulary


@dataclass
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def synthetic(wcfg, vocab_size: int, bos_id: int = 2) -> Workload:
    """Seeded random prompts (BOS + random ordinary tokens), lengths uniform in [min, max]."""
    rng = np.random.default_rng(int(wcfg.seed))
    lengths = rng.integers(wcfg.min_prompt_len, wcfg.max_prompt_len + 1, size=wcfg.num_prompts)
    prompts = [[bos_id] + rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, size=n - 1).tolist() for n in lengths]
    params = [
        SamplingParams(
            max_new_tokens=int(wcfg.max_new_tokens), temperature=float(wcfg.temperature), top_k=int(wcfg.top_k),
            top_p=float(wcfg.top_p), ignore_eos=bool(wcfg.ignore_eos), seed=int(wcfg.seed) + i,
        )
        for i in range(len(prompts))
    ]
    return Workload(prompts, params)


def build_workload(cfg, engine) -> Workload:
    if cfg.workload.path:
        raise NotImplementedError("workload.path (JSONL prompts) is not available in this build yet")
    return synthetic(cfg.workload, engine.spec.vocab_size)
