"""`token_logprobs(head, tokens, softcap)`: each row's log-probability of one token under the model
(soft-capped logits, temperature 1, no filter), whose order depends on nothing but the vocabulary.

The log-sum-exp runs over `LANES` lanes: lane j takes logits j, j + LANES, j + 2 LANES, ... in order,
keeping its own running max and rescaled sum of exponentials; the lanes are combined once at the end.
`LogprobStream` exposes those steps, so a caller that computes the head a slice of the vocabulary at a
time (the trainer's chunked log-probabilities, model/trainable.py) gets the same bits as the sampler
and `engine.score()`, which run the whole vocabulary through the same steps in one go.
"""

from __future__ import annotations

from typing import Optional

import torch

from flexgemma.model.invariant.rows import pad_rows, padded_row_count, serial

CPU_LANES = 64


def lanes(device: torch.device) -> int:
    """The lanes of the device's log-sum-exp (the GPU kernels': triton_logprobs.LANES)."""
    if device.type == "cuda":
        from flexgemma.model.invariant.triton_logprobs import LANES

        return LANES
    return CPU_LANES


class LogprobStream:
    """Per-row lane state over a vocabulary taken in slices of whole lane steps, in order."""

    def __init__(self, rows: int, device: torch.device, softcap: Optional[float]):
        self.softcap, self.device, self.lanes = softcap, device, lanes(device)
        self.lane_max = torch.full((rows, self.lanes), float("-inf"), dtype=torch.float32, device=device)
        self.lane_sum = torch.zeros(rows, self.lanes, dtype=torch.float32, device=device)

    def update(self, head: torch.Tensor) -> None:
        """head [rows, V_slice] (V_slice a multiple of the lanes, or the vocabulary's last slice)."""
        if self.device.type == "cuda":
            from flexgemma.model.invariant import triton_logprobs

            triton_logprobs.update(head, self.lane_max, self.lane_sum, self.softcap)
            return
        z = capped(head, self.softcap)
        t, v = z.shape
        steps = -(-v // self.lanes)
        z = torch.nn.functional.pad(z, (0, steps * self.lanes - v), value=float("-inf")).view(t, steps, self.lanes)
        for i in range(steps):
            new = torch.maximum(self.lane_max, z[:, i])
            safe = torch.where(new == float("-inf"), 0.0, new)
            self.lane_sum = self.lane_sum * torch.exp(self.lane_max - safe) + torch.exp(z[:, i] - safe)
            self.lane_max = new

    def capped(self, head: torch.Tensor) -> torch.Tensor:
        return capped(head, self.softcap)

    def logprobs(self, target_head: torch.Tensor) -> torch.Tensor:
        """[rows] float32: each row's target (its head value, [rows]) capped, minus the lanes combined."""
        if self.device.type == "cuda":
            from flexgemma.model.invariant import triton_logprobs

            return triton_logprobs.finish(self.lane_max, self.lane_sum, target_head, self.softcap)
        top = self.lane_max.amax(-1)
        lse = top + torch.log((self.lane_sum * torch.exp(self.lane_max - top[:, None])).sum(-1))
        return capped(target_head, self.softcap) - lse


def capped(head: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """float32 soft-capped logits (the GPU kernels compute cap * tanh(x / cap) through exp: other last bits)."""
    z = head.float()
    return z if softcap is None else torch.tanh(z / softcap) * softcap


def token_logprobs(head: torch.Tensor, tokens: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """head [T, V] (the lm_head's output, before the soft-cap), tokens [T] -> float32 [T]: one
    `LogprobStream` over the whole vocabulary, the steps the trainer's sliced head takes too."""
    if head.is_cuda:
        return _streamed(head, tokens.long(), softcap)
    t = head.shape[0]
    n = padded_row_count(t)  # whole vector steps in every elementwise loop (rows.py)
    with serial():
        return _streamed(pad_rows(head, n), pad_rows(tokens.long(), n), softcap)[:t]


def _streamed(head: torch.Tensor, tokens: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    stream = LogprobStream(head.shape[0], head.device, softcap)
    stream.update(head)
    return stream.logprobs(head.gather(-1, tokens[:, None])[:, 0])
