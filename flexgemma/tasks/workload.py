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

from flexgemma.config.schema import ConfigError
from flexgemma.engine.kv_cache import PoolDemand
from flexgemma.engine.sequence import SamplingParams
from flexgemma.engine.text import messages_problem, text_problem

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
            params.append(sampling_params(wcfg, i * n + j))
    return Workload(reqs, params, index, sources or [])


def synthetic(wcfg, vocab_size: int, bos_id: int = 2) -> Workload:
    """Seeded random prompts (BOS + random ordinary tokens), lengths uniform in [min, max]."""
    if wcfg.num_prompts is None:
        raise ConfigError("workload.num_prompts must be set for the synthetic workload (e.g. workload.num_prompts=16)")
    rng = np.random.default_rng(int(wcfg.seed))
    lengths = rng.integers(wcfg.min_prompt_len, wcfg.max_prompt_len + 1, size=wcfg.num_prompts)
    prompts = [[bos_id] + rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, size=n - 1).tolist() for n in lengths]
    return _repeat(prompts, wcfg)


MAX_LISTED_PROBLEMS = 20  # a file of a million bad lines gets the first ones and a count


class WorkloadError(ConfigError):
    """A prompts file that cannot run; the message lists every bad line (file:line: what is wrong)."""


def read_prompts_file(wcfg) -> list[tuple[str, Any]]:
    """The (file:line, record) prompt lines of workload.path, at most workload.num_prompts, every one
    checked before anything is built: WorkloadError lists all bad lines at once."""
    path = Path(str(wcfg.path)).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"workload.path={path}: no such file (a JSONL file of prompts, one a line)")
    records, problems = [], []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if wcfg.num_prompts is not None and len(records) + len(problems) >= int(wcfg.num_prompts):
                    break
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except ValueError as e:
                    problems.append(f"{where}: not JSON ({e})")
                    continue
                except RecursionError:
                    problems.append(f"{where}: JSON nested too deeply to read")
                    continue
                problem = record_problem(record)
                if problem:
                    problems.append(f"{where}: {problem}")
                else:
                    records.append((where, record))
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"workload.path={path}: cannot be read ({type(e).__name__}: {e})") from None
    if problems:
        more = len(problems) - MAX_LISTED_PROBLEMS
        listed = problems[:MAX_LISTED_PROBLEMS] + ([f"... and {more} more"] if more > 0 else [])
        raise WorkloadError(f"workload.path={path}: {len(problems)} bad lines (no prompt of it ran):\n  "
                            + "\n  ".join(listed))
    if not records:
        raise WorkloadError(f"workload.path={path} holds no prompts")
    return records


def record_problem(record: Any) -> Optional[str]:
    """What is wrong with one prompt line's JSON value (None: nothing)."""
    if isinstance(record, str):
        return _prompt_problem(record)
    if not isinstance(record, Mapping):
        return f"expected an object with 'prompt', 'messages' or 'prompt_token_ids', got a {type(record).__name__}"
    kinds = [k for k in ("prompt_token_ids", "messages", "prompt") if k in record]
    if not kinds:
        return f"expected a key 'prompt' (text), 'messages' (chat) or 'prompt_token_ids'; got {sorted(record)}"
    value = record[kinds[0]]
    if kinds[0] == "prompt_token_ids":
        if not isinstance(value, list) or not value or not all(_is_int(t) and t >= 0 for t in value):
            return "prompt_token_ids must be a non-empty list of non-negative integers"
        return None
    elif kinds[0] == "prompt":
        return _prompt_problem(value) if isinstance(value, str) else "prompt must be a non-empty string"
    elif not isinstance(value, list) or not value:
        return "messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects"
    return messages_problem(value)


def _prompt_problem(text: str) -> Optional[str]:
    if not text:
        return "prompt must be a non-empty string"
    problem = text_problem(text)
    return f"prompt text {problem}" if problem else None


def _is_int(t: Any) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, bool)


def jsonl(wcfg, tokenizer, records: Optional[list[tuple[str, Any]]] = None) -> Workload:
    """Prompts of a JSONL file (text, chat messages or token ids), at most workload.num_prompts.
    records: the file as read_prompts_file read it before the model was built (read again if None)."""
    records = read_prompts_file(wcfg) if records is None else records
    prompts, sources = [], []
    for where, record in records:
        ids, source = _tokenise(record, tokenizer, where)
        prompts.append(ids)
        sources.append(source)
    return _repeat(prompts, wcfg, sources)


def _tokenise(record: Any, tokenizer, where: str) -> tuple[list[int], Any]:
    if isinstance(record, str):
        record = {"prompt": record}
    if "prompt_token_ids" in record:
        ids = [int(t) for t in record["prompt_token_ids"]]
        return ids, ids
    kind = "messages" if "messages" in record else "prompt"
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


def build_workload(cfg, engine, records: Optional[list[tuple[str, Any]]] = None) -> Workload:
    """The workload's requests, each checked against the engine (vocabulary, max_model_len): a
    WorkloadError lists every request that could only end in an error, before any runs."""
    w = cfg.workload
    workload = jsonl(w, engine.tokenizer, records) if w.path else synthetic(w, engine.spec.vocab_size)
    check_requests(workload, engine)
    return workload


def check_requests(workload: Workload, engine) -> None:
    problems, seen = [], set()
    for req, (prompt, params) in enumerate(zip(workload.prompts, workload.params)):
        src = workload.prompt_index[req]
        if src in seen:
            continue  # the n samples of a prompt share its problems (their seeds are valid)
        seen.add(src)
        for p in engine.request_problems(prompt, params):
            problems.append(f"prompt {src}: {p}")
    if problems:
        more = len(problems) - MAX_LISTED_PROBLEMS
        raise WorkloadError(f"{len(problems)} problems with the workload's requests (none ran):\n  "
                            + "\n  ".join(problems[:MAX_LISTED_PROBLEMS] + ([f"... and {more} more"] if more > 0 else [])))


def sampling_params(wcfg, seed_offset: int = 0) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=int(wcfg.max_new_tokens), temperature=float(wcfg.temperature), top_k=int(wcfg.top_k),
        top_p=float(wcfg.top_p), ignore_eos=bool(wcfg.ignore_eos), seed=int(wcfg.seed) + seed_offset,
    )


def check_workload(cfg) -> Optional[list[tuple[str, Any]]]:
    """What can be checked before the model is built: the sampling settings, and the prompts file
    (returned, read once). Raises WorkloadError naming every problem."""
    w = cfg.workload
    try:
        sampling_params(w)
    except ValueError as e:  # SamplingParams checks itself
        raise WorkloadError(f"workload sampling settings cannot run: {str(e).removeprefix('invalid SamplingParams: ')}"
                            " (workload.temperature / top_k / top_p / max_new_tokens / seed)") from None
    return read_prompts_file(w) if w.path else None


def pool_demand(wcfg) -> PoolDemand:
    """What the workload asks of the KV pool at once: every request in flight (a GRPO group counts n
    times), each as long as the longest prompt plus its new tokens. A prompts file's lengths are not
    known before its tokenizer exists: then the engine's max_model_len bounds them."""
    seqs = int(wcfg.num_prompts) * int(wcfg.n) if wcfg.num_prompts else None
    tokens = None if wcfg.path else int(wcfg.max_prompt_len) + int(wcfg.max_new_tokens)
    return PoolDemand(seqs, tokens)
