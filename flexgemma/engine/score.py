"""engine.score: the log-probabilities of given tokens (teacher forcing) through the engine's forward.

Each sequence runs as a prompt through the scheduler's packed, chunked prefill steps, on KV pages
like any request; the runner returns the logits of the rows that predict a scored token (positions
prompt_len-1 .. len-2), and the sequence's pages are freed as soon as its last needed row is
computed. The log-probabilities use the sampler's own formula (logit minus the row's logsumexp,
at temperature 1, unfiltered), so they equal what generate() reported for the same tokens.

Memory: a step's scored rows go through the LM head and the log-probabilities in parts of at most
HEAD_PART_BYTES of float32 logits (1,024 rows of a 262k vocabulary), not all of a step's rows at once
(8,192 rows of float32 logits are 8.6 GB, and their logsumexp as much again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from flexgemma.engine.sampler import logsumexp_rows
from flexgemma.engine.sequence import SamplingParams, Sequence, is_int, prompt_tokens

# seq ids of scoring sequences (they own KV pages like requests): far above any request id
SCORE_ID_BASE = 1 << 30
# float32 logits a part of the scored rows may take (the head's bf16 output and the logsumexp's
# temporaries come beside them)
HEAD_PART_BYTES = 1 << 30


def head_part_rows(vocab: int) -> int:
    """How many scored rows go through the head and the log-probabilities at once."""
    return max(1, HEAD_PART_BYTES // (4 * vocab))


@dataclass
class ScoreOutput:
    """The scores of one sequence: its tokens from prompt_len on, and their log-probabilities."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None  # per token: the top_k (token, logprob)
    # MoE models with return_routed_experts: uint8 [tokens, MoE layers, top-k], the rows that scored them
    routed_experts: Optional[np.ndarray] = None


_WANT = {"sequences": "a list of token-id lists", "prompt_lens": "a list of ints, one per sequence"}


def score_problems(engine, sequences, prompt_lens) -> tuple[list[list[int]], list, list[str]]:
    """(the sequences as lists of ints, prompt_lens as a list, everything wrong with the call)."""
    for name, value in (("sequences", sequences), ("prompt_lens", prompt_lens)):
        if value is None or isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
            return [], [], [f"{name}={value!r:.60} is not {_WANT[name]}"]
    sequences, prompt_lens = list(sequences), list(prompt_lens)
    if len(sequences) != len(prompt_lens):
        return [], prompt_lens, [f"{len(sequences)} sequences but {len(prompt_lens)} prompt_lens"]
    seqs, errs = [], []
    for i, (seq, plen) in enumerate(zip(sequences, prompt_lens)):
        tokens, err = prompt_tokens(seq)
        if err:
            errs.append(f"sequence {i}: {err}")
            continue
        if not is_int(plen) or not 1 <= plen < len(tokens):
            errs.append(f"sequence {i}: prompt_len={plen!r} must be an int in [1, {len(tokens) - 1}] "
                        f"(at least one prompt token and one scored token)")
        if len(tokens) > engine.max_model_len:
            errs.append(f"sequence {i}: {len(tokens)} tokens exceed engine.max_model_len={engine.max_model_len}")
        bad = [t for t in tokens if not 0 <= t < engine.spec.vocab_size]
        if bad:
            errs.append(f"sequence {i}: token id {bad[0]} is outside the vocabulary [0, {engine.spec.vocab_size})")
        seqs.append(tokens)
    return seqs, prompt_lens, errs


def run_score(engine, token_lists: list[list[int]], prompt_lens: list[int], top_k: int,
              routed: bool = False) -> list[ScoreOutput]:
    """Scores on an idle engine (the caller holds its lock); frees every page it took, even on failure."""
    sch = engine.scheduler
    # no prefix cache: every row whose logits it needs must be computed
    seqs = [Sequence(SCORE_ID_BASE + i, i, toks, SamplingParams(max_new_tokens=1), seed=0, prefix_cacheable=False)
            for i, toks in enumerate(token_lists)]
    outs = [ScoreOutput(i, toks[p:], [0.0] * (len(toks) - p), [[] for _ in toks[p:]] if top_k else None)
            for i, (toks, p) in enumerate(zip(token_lists, prompt_lens))]
    for s in seqs:
        sch.add(s)
    try:
        while sch.has_work:
            plan = sch.schedule()
            if plan.kind != "prefill":  # every score sequence finishes right after its prefill
                raise RuntimeError(f"engine.score: the scheduler planned a {plan.kind} step")
            rows, where = [], []
            t = 0
            for s, n in zip(plan.seqs, plan.chunk_lens):
                start = s.num_computed
                for p in range(max(start, prompt_lens[s.index] - 1), min(start + n, s.num_tokens - 1)):
                    rows.append(t + p - start)
                    where.append((s.index, p))
                t += n
            hidden, routing = engine.runner.prefill_hidden(plan, rows or [0])
            part = head_part_rows(engine.spec.vocab_size)
            for a in range(0, len(rows), part):
                _fill(outs, token_lists, prompt_lens, where[a: a + part], hidden[a: a + part], top_k, engine.runner)
            if rows and routed and routing is not None:
                _fill_routing(outs, prompt_lens, where, routing)
            for s, n in zip(list(plan.seqs), plan.chunk_lens):
                s.num_computed += n
                sch.reclaim(s)
                if s.num_computed >= s.num_tokens - 1:
                    sch.finish(s, "stop")
    except BaseException:
        sch.abort_all(seqs)
        raise
    return outs


def _fill_routing(outs, prompt_lens, where, routing: torch.Tensor) -> None:
    rows = routing.cpu().numpy()
    for r, (i, p) in enumerate(where):
        if outs[i].routed_experts is None:
            outs[i].routed_experts = np.zeros((len(outs[i].token_ids), *rows.shape[1:]), dtype=np.uint8)
        outs[i].routed_experts[p + 1 - prompt_lens[i]] = rows[r]


@torch.inference_mode()
def _fill(outs, token_lists, prompt_lens, where, hidden: torch.Tensor, top_k: int, runner) -> None:
    """Writes the log-probability of each row's next given token (and the row's top_k), from the rows'
    final hidden states. Under engine.batch_invariant through the function the sampler used when it drew
    the token."""
    head = runner.forward.head(hidden)
    logits = runner.forward.logits(head)
    target = torch.tensor([token_lists[i][p + 1] for i, p in where], device=logits.device)
    if runner.invariant:
        from flexgemma.model.invariant.logprobs import token_logprobs

        chosen_t = token_logprobs(head, target, runner.forward.spec.softcap)
        lse = logits.gather(-1, target[:, None])[:, 0] - chosen_t  # the row's log-sum-exp, as the kernel had it
    else:
        lse = logsumexp_rows(logits)
        chosen_t = logits.gather(-1, target[:, None])[:, 0] - lse
    chosen = chosen_t.tolist()
    if top_k:
        vals, ids = torch.topk(logits, top_k, dim=-1)
        top = list(zip(ids.tolist(), (vals - lse[:, None]).tolist()))
    for r, (i, p) in enumerate(where):
        k = p + 1 - prompt_lens[i]
        outs[i].logprobs[k] = chosen[r]
        if top_k:
            outs[i].top_logprobs[k] = list(zip(top[r][0], top[r][1]))
