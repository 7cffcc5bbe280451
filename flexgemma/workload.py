"""Workloads: the prompts (and sampling) a task runs through the engine.

- `workload=synthetic`: seeded random prompts (BOS + random ordinary tokens), EOS ignored so every
  engine does the same work.
- `workload=jsonl workload.path=FILE`: one prompt a line, as text (`{"prompt": "..."}`), chat
  messages (`{"messages": [{"role": "user", "content": "..."}]}`, through the checkpoint's chat
  template) or token ids (`{"prompt_token_ids": [2, 651, ...]}`). Text and messages are tokenised
  with the tokenizer of `model.path`.

Either way `workload.n` repeats each prompt n times with distinct seeds (a GRPO group).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from flexgemma.config import ConfigError
from flexgemma.engine.kv_cache import PoolDemand
from flexgemma.engine.sequence import SamplingParams

FIRST_ORDINARY_TOKEN = 3  # 0 pad, 1 eos, 2 bos in every Gemma-4 vocabulary


@dataclass
class Workload:
    prompts: list[list[int]]  # one entry per request: each source prompt n times in a row
    params: list[SamplingParams]
    prompt_index: list[int] = field(default_factory=list)  # request -> source prompt
    sources: list[Any] = field(default_factory=list)  # source prompt as given (text, messages), if any

    def __post_init__(self):
        if not self.prompt_index:
            self.prompt_index = list(range(len(self.prompts)))

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def completion_rows(self, outputs, tokenizer=None) -> list[dict]:
        """One row per request for completions.jsonl."""
        rows, seen = [], {}
        for req, out in enumerate(outputs):
            src = self.prompt_index[req]
            sample = seen[src] = seen.get(src, -1) + 1
            row: dict[str, Any] = {"prompt_index": src, "sample": sample, "seed": self.params[req].seed}
            if self.sources:
                row["prompt"] = self.sources[src]
            row.update(prompt_tokens=len(self.prompts[req]), token_ids=list(out.token_ids),
                       finish_reason=out.finish_reason, logprob_sum=float(sum(out.logprobs)))
            if tokenizer is not None:
                row["completion"] = tokenizer.decode(out.token_ids, skip_special_tokens=True)
            if out.error:
                row["error"] = out.error
            rows.append(row)
        return rows


def _repeat(prompts: list[list[int]], wcfg, sources: Optional[list] = None) -> Workload:
    """Each prompt n times (workload.n), every request with its own seed."""
    n = int(wcfg.n)
    reqs, index, params = [], [], []
    for i, p in enumerate(prompts):
        for j in range(n):
            reqs.append(list(p))
            index.append(i)
            params.append(SamplingParams(
                max_new_tokens=int(wcfg.max_new_tokens), temperature=float(wcfg.temperature),
                top_k=int(wcfg.top_k), top_p=float(wcfg.top_p), ignore_eos=bool(wcfg.ignore_eos),
                seed=int(wcfg.seed) + i * n + j,
            ))
    return Workload(reqs, params, index, sources or [])


def synthetic(wcfg, vocab_size: int, bos_id: int = 2) -> Workload:
    """Seeded random prompts (BOS + random ordinary tokens), lengths uniform in [min, max]."""
    if wcfg.num_prompts is None:
        raise ConfigError("workload.num_prompts must be set for the synthetic workload (e.g. workload.num_prompts=16)")
    rng = np.random.default_rng(int(wcfg.seed))
    lengths = rng.integers(wcfg.min_prompt_len, wcfg.max_prompt_len + 1, size=wcfg.num_prompts)
    prompts = [[bos_id] + rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, size=n - 1).tolist() for n in lengths]
    return _repeat(prompts, wcfg)


def jsonl(wcfg, tokenizer) -> Workload:
    """Prompts of a JSONL file (text, chat messages or token ids), at most workload.num_prompts."""
    path = Path(str(wcfg.path)).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"workload.path={path}: no such file (a JSONL file of prompts, one a line)")
    prompts, sources = [], []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if wcfg.num_prompts is not None and len(prompts) >= wcfg.num_prompts:
                break
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
            ids, source = _tokenise(record, tokenizer, f"{path}:{lineno}")
            prompts.append(ids)
            sources.append(source)
    if not prompts:
        raise ValueError(f"workload.path={path} holds no prompts")
    return _repeat(prompts, wcfg, sources)


def _tokenise(record: Any, tokenizer, where: str) -> tuple[list[int], Any]:
    if isinstance(record, str):
        record = {"prompt": record}
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected an object with 'prompt', 'messages' or 'prompt_token_ids'")
    if "prompt_token_ids" in record:
        ids = record["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{where}: prompt_token_ids must be a list of integers")
        return ids, ids
    kind = "messages" if "messages" in record else "prompt" if "prompt" in record else None
    if kind is None:
        raise ValueError(f"{where}: expected a key 'prompt' (text), 'messages' (chat) or 'prompt_token_ids'; "
                         f"got {sorted(record)}")
    if tokenizer is None:
        raise ConfigError(
            f"{where}: a {kind} prompt needs the checkpoint's tokenizer, and this model has none: give "
            "model.path=DIR of a checkpoint with tokenizer.json, or write prompt_token_ids instead"
        )
    if kind == "prompt":
        return list(tokenizer(record["prompt"]).input_ids), record["prompt"]
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{where}: chat messages need a chat template, and the tokenizer of model.path has none "
                          "(chat_template.jinja / tokenizer_config.json); give text prompts instead")
    ids = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids), record["messages"]


def build_workload(cfg, engine) -> Workload:
    w = cfg.workload
    if w.path:
        return jsonl(w, engine.tokenizer)
    return synthetic(w, engine.spec.vocab_size)


def pool_demand(wcfg) -> PoolDemand:
    """What the workload asks of the KV pool at once: every request in flight (a GRPO group counts n
    times), each as long as the longest prompt plus its new tokens. A prompts file's lengths are not
    known before its tokenizer exists: then the engine's max_model_len bounds them."""
    seqs = int(wcfg.num_prompts) * int(wcfg.n) if wcfg.num_prompts else None
    tokens = None if wcfg.path else int(wcfg.max_prompt_len) + int(wcfg.max_new_tokens)
    return PoolDemand(seqs, tokens)
