"""`token_logprobs(head, tokens, softcap)`: each row's log-probability of one token under the model
(soft-capped logits, temperature 1, no filter), in one pass per row whose order depends on nothing
but the vocabulary size. The sampler (decode) and `engine.score()` (prefill) both call it, so a token
scored later gets the bits it was generated with."""

from __future__ import annotations

from typing import Optional

import torch

from flexgemma.model.invariant.rows import pad_rows, padded_row_count, serial

_CPU_CHUNKS = 64  # the vocabulary in fixed pieces: the same per-row reductions whatever the row count


def token_logprobs(head: torch.Tensor, tokens: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """head [T, V] (the lm_head's output, before the soft-cap), tokens [T] -> float32 [T]."""
    if head.is_cuda:
        from flexgemma.model.invariant import triton_logprobs

        return triton_logprobs.token_logprobs(head, tokens, softcap)
    t = head.shape[0]
    n = padded_row_count(t)  # whole vector steps in every elementwise loop (rows.py)
    with serial():
        return _token_logprobs_cpu(pad_rows(head, n), pad_rows(tokens.long(), n), softcap)[:t]


def _token_logprobs_cpu(head: torch.Tensor, tokens: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    z = head.float()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    t, v = z.shape
    chunks = z.view(t, _CPU_CHUNKS, v // _CPU_CHUNKS) if v % _CPU_CHUNKS == 0 else z.view(t, 1, v)
    peak = chunks.amax(-1).amax(-1)
    mass = torch.exp(chunks - peak[:, None, None]).sum(-1).sum(-1)
    return z.gather(-1, tokens[:, None])[:, 0] - (peak + torch.log(mass))
