"""Sampling on the device: greedy, temperature, top-k, top-p, with per-request seeds.

The random draw of a request at position p is Gumbel-max over noise that is a hash of
(seed, p, token id): it depends on nothing else in the batch, needs no generator state (so it
replays inside a CUDA graph), and a preempted request that is recomputed draws the same tokens.
Logprobs are those of the chosen token under the model's distribution (temperature 1, no filter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flexgemma.model.glue import final_logits

_MASK31 = 0x7FFFFFFF


def _mix(h: torch.Tensor) -> torch.Tensor:
    # 31-bit values times 31-bit odd constants stay below 2**62: no int64 overflow on any device
    h = ((h >> 16) ^ h) * 0x45D9F3B & _MASK31
    h = ((h >> 16) ^ h) * 0x2C1B3C6D & _MASK31
    h = ((h >> 15) ^ h) * 0x297A2D39 & _MASK31
    return (h >> 16) ^ h


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 in (0, 1), a pure function of (seed, position, token id)."""
    key = _mix((seeds.long() & _MASK31) ^ _mix((positions.long() * 0x27D4EB2F) & _MASK31))
    tok = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    h = _mix(key[:, None] ^ ((tok[None, :] * 0x165667B1) & _MASK31))
    h = _mix(h ^ key[:, None])
    return unit_interval(h)


def unit_interval(h: torch.Tensor) -> torch.Tensor:
    """31-bit hashes -> float32 uniforms strictly inside (0, 1): (h + 0.5) / 2**31, finest near 0 (exact there),
    the top 64 hashes (which round to 1.0 in float32) held at the largest float32 below 1."""
    return torch.clamp_max(((h & _MASK31).float() + 0.5) * (1.0 / 2147483648.0), 1.0 - 2.0 ** -24)


def gumbel_noise(u: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(E) from uniforms u, E = -log(1 - u) ~ Exp(1): a large noise (the likely winner's
    over a flat row) comes from a small u, where float32 is finest, so the tail keeps its resolution; from
    -log(-log(u)) it would come from u near 1, a grid of 2**-24 steps (noise about 0.016 nats apart there). Finite
    for every u of unit_interval: rounded to 1.0, one hash in 3e7 drew its token whatever the logits."""
    return -torch.log(-torch.log1p(-u))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32; 1 = off
    seed: torch.Tensor  # [B] int64
    position: torch.Tensor  # [B] int64: position of the token being drawn
    needs_filter: bool  # some row uses top-k or top-p (sorting the vocabulary is skipped otherwise)
    greedy_only: bool = False  # every row is greedy: no noise over the vocabulary is drawn


# Reductions over the vocabulary run as [B, CHUNKS, V/CHUNKS]: B * 64 programs instead of B. One
# program a row over 262,144 logits left most of the H200 idle: 2.0 ms a bs-64 step (39% of it).
_CHUNKS = 64


def _chunks(x: torch.Tensor) -> torch.Tensor:
    b, v = x.shape
    return x.view(b, _CHUNKS, v // _CHUNKS) if v % _CHUNKS == 0 else x.view(b, 1, v)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of a [B, V] tensor, the first maximum as torch's: the best chunk's best index."""
    c = _chunks(x)
    values, index = c.max(dim=-1)  # [B, C]
    best = values.argmax(dim=-1)  # the first chunk holding the maximum
    return best * c.shape[-1] + index.gather(-1, best[:, None])[:, 0]


def logsumexp_rows(x: torch.Tensor, softcap: Optional[float] = None) -> torch.Tensor:
    """torch.logsumexp(final_logits(x, softcap), -1) of a [B, V] tensor, per chunk first. With `softcap`,
    x is the head's output: the cap is monotonic, so a chunk's peak is its raw maximum capped, and the
    tanh runs once an element, in the sum (a compiled pass over the capped values for the peaks spent a
    second tanh an element)."""
    c = _chunks(x)
    peak = final_logits(c.amax(dim=-1), softcap)  # [B, C]
    total = peak.amax(dim=-1)  # [B]
    mass = torch.exp(final_logits(c, softcap) - peak[..., None]).sum(dim=-1) * torch.exp(peak - total[:, None])
    return total + torch.log(mass.sum(dim=-1))


def sample(logits: torch.Tensor, p: SamplingBatch, softcap: Optional[float] = None,
           logprobs: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits [B, V] -> (tokens [B] int64, logprobs [B] float32, or None without `logprobs`). With
    `softcap`, `logits` is the model head's output and is soft-capped here (cap * tanh(x / cap), in
    float32, as the model's own logits), inside the compiled graph that reads it."""
    capped = final_logits(logits, softcap)
    # the cap is monotonic: the greedy token is the raw output's first maximum (no tanh), the capped
    # logits' own except where float32 tanh saturates two raw values to one (|x| > ~7 caps)
    greedy = argmax_rows(logits)
    if p.greedy_only:
        tokens = greedy
    else:
        temp = p.temperature.clamp_min(1e-5)[:, None]
        scaled = capped / temp
        if p.needs_filter:
            scaled = _filter_top_k_top_p(scaled, p.top_k, p.top_p)
        u = hash_uniform(p.seed, p.position, logits.shape[-1])
        gumbel = gumbel_noise(u)
        drawn = argmax_rows(scaled + gumbel)
        tokens = torch.where(p.temperature > 0, drawn, greedy)
    if not logprobs:
        return tokens, None
    return tokens, capped.gather(-1, tokens[:, None])[:, 0] - logsumexp_rows(logits, softcap)


class InvariantSampler:
    """engine.batch_invariant: tokens drawn by `sample_fn` (a per-element computation and an argmax:
    a row's draw never depends on the batch), their logprobs by `invariant.logprobs.token_logprobs`,
    the function engine.score() calls too."""

    def __init__(self, sample_fn):
        self.sample_fn = sample_fn

    def __call__(self, head: torch.Tensor, p: SamplingBatch, softcap: Optional[float] = None):
        from flexgemma.model.invariant.logprobs import token_logprobs
        from flexgemma.model.invariant.rows import pad_rows, padded_row_count, serial

        if head.is_cuda:
            tokens, _ = self.sample_fn(head, p, softcap, logprobs=False)
        else:  # the CPU's elementwise loops: rows padded, one thread (model/invariant/rows.py)
            t = head.shape[0]
            n = padded_row_count(t)
            padded = SamplingBatch(*(pad_rows(x, n) for x in (p.temperature, p.top_k, p.top_p, p.seed, p.position)),
                                   p.needs_filter, p.greedy_only)
            with serial():
                tokens = self.sample_fn(pad_rows(head, n), padded, softcap, logprobs=False)[0][:t]
        return tokens, token_logprobs(head, tokens, softcap)


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p on the top-k renormalised: -inf outside. The probabilities are sorted, not
    the logits, so the cumulative sum reads a sorted (materialised) tensor and nothing broadcast per
    row: inductor's split scan (a scan over > 128 columns) crashes on a per-row operand in torch
    2.11 (pytorch#180221). Top-p on the renormalised top-k is then (mass before) > top_p * (top-k mass)."""
    vocab = scaled.shape[-1]
    sorted_probs, order = torch.softmax(scaled, dim=-1).sort(dim=-1, descending=True)
    mass = sorted_probs.cumsum(dim=-1)
    k = torch.where(top_k > 0, top_k, vocab).clamp_max(vocab)[:, None]
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    kept_mass = mass.gather(-1, k - 1)  # [B, 1]: the top-k's mass
    drop = (rank >= k) | (mass - sorted_probs > top_p[:, None] * kept_mass)  # the first candidate always stays
    return scaled.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), float("-inf"))
