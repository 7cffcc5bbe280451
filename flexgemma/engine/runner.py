"""Step plan -> input tensors -> forward (eager, or a captured CUDA graph for decode) -> sampled tokens.

The runner computes; the scheduler decides. Decode inputs live in persistent buffers sized for
the largest batch, so eager decode and graph replay read the same tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from flexgemma.engine.block_mask import MaskBuilder
from flexgemma.engine.kv_cache import SINK_PAGE, KVCache
from flexgemma.engine.sampler import SamplingBatch, sample
from flexgemma.engine.scheduler import StepPlan
from flexgemma.engine.sequence import Sequence
from flexgemma.model.forward import GemmaForward


class DecodeInputs:
    """Everything a decode step reads, as persistent device buffers of `max_batch` rows."""

    def __init__(self, masks: MaskBuilder, max_batch: int, device: torch.device):
        z = lambda dtype: torch.zeros(max_batch, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = z(torch.long)
        self.positions = z(torch.long)
        self.slots = z(torch.long)
        self.temperature = z(torch.float32)
        self.top_k = z(torch.long)
        self.top_p = torch.ones(max_batch, dtype=torch.float32, device=device)
        self.seed = z(torch.long)
        self.mask_buffers = masks.decode_buffers(max_batch)


def _sampling_rows(seqs: list[Sequence], rows: int):
    temp = np.zeros(rows, dtype=np.float32)
    top_k = np.zeros(rows, dtype=np.int64)
    top_p = np.ones(rows, dtype=np.float32)
    seed = np.zeros(rows, dtype=np.int64)
    for i, s in enumerate(seqs):
        temp[i], top_k[i], top_p[i], seed[i] = s.params.temperature, s.params.top_k, s.params.top_p, s.seed
    needs_filter = any(s.params.temperature > 0 and (s.params.top_k > 0 or s.params.top_p < 1) for s in seqs)
    return temp, top_k, top_p, seed, needs_filter


class ModelRunner:
    def __init__(self, forward: GemmaForward, cache: KVCache, masks: MaskBuilder, max_batch: int, q_block: int):
        self.forward, self.cache, self.masks = forward, cache, masks
        self.device = cache.page_owner.device
        self.q_block = q_block
        self.page_size = cache.page_size
        self.decode_in = DecodeInputs(masks, max_batch, self.device)
        self._decode_masks: dict[int, dict] = {}  # rows -> BlockMasks over the persistent buffers
        self.graphs = None  # set by cuda_graphs.attach()

    def _slot(self, s: Sequence, pos: int) -> int:
        return s.pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def _to_dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[list[int], list[float]]:
        """Runs one step; returns the sampled token and logprob of each sequence that samples."""
        if plan.kind == "prefill":
            logits, sampled = self._prefill(plan)
            seqs = [s for i, s in enumerate(plan.seqs) if sampled[i]]
            positions = [s.num_computed + n for s, n, smp in zip(plan.seqs, plan.chunk_lens, sampled) if smp]
        else:
            logits = self._decode(plan.seqs)
            seqs = plan.seqs
            positions = [s.num_tokens for s in seqs]
        if not seqs:
            return [], []
        temp, top_k, top_p, seed, needs_filter = _sampling_rows(seqs, len(seqs))
        batch = SamplingBatch(
            temperature=self._to_dev(temp), top_k=self._to_dev(top_k), top_p=self._to_dev(top_p),
            seed=self._to_dev(seed), position=self._to_dev(np.asarray(positions, dtype=np.int64)),
            needs_filter=needs_filter,
        )
        tokens, logprobs = sample(logits[: len(seqs)], batch)
        return tokens.tolist(), logprobs.tolist()

    def _prefill(self, plan: StepPlan):
        total = plan.num_tokens
        padded = -(-total // self.q_block) * self.q_block
        ids = np.zeros(padded, dtype=np.int64)
        pos = np.zeros(padded, dtype=np.int64)
        slots = np.full(padded, SINK_PAGE * self.page_size, dtype=np.int64)
        last, sampled = [], []
        t = 0
        for s, n in zip(plan.seqs, plan.chunk_lens):
            toks = s.tokens
            p0 = s.num_computed
            ids[t: t + n] = toks[p0: p0 + n]
            pos[t: t + n] = np.arange(p0, p0 + n)
            slots[t: t + n] = [self._slot(s, p) for p in range(p0, p0 + n)]
            smp = p0 + n == s.num_tokens
            sampled.append(smp)
            if smp:
                last.append(t + n - 1)
            t += n
        masks = self.masks.prefill(plan.seqs, plan.chunk_lens, padded)
        index = self._to_dev(np.asarray(last, dtype=np.int64))
        logits = self.forward(self._to_dev(ids), self._to_dev(pos), self._to_dev(slots), masks, index, decode=False)
        return logits, sampled

    def fill_decode(self, seqs: list[Sequence], rows: int) -> None:
        """Copies the step's values into the persistent decode buffers (rows past len(seqs) pad)."""
        d = self.decode_in
        ids = np.zeros(rows, dtype=np.int64)
        pos = np.zeros(rows, dtype=np.int64)
        slots = np.full(rows, SINK_PAGE * self.page_size, dtype=np.int64)
        for i, s in enumerate(seqs):
            p = s.num_tokens - 1
            ids[i], pos[i], slots[i] = s.tokens[p], p, self._slot(s, p)
        d.input_ids[:rows].copy_(torch.from_numpy(ids), non_blocking=True)
        d.positions[:rows].copy_(torch.from_numpy(pos), non_blocking=True)
        d.slots[:rows].copy_(torch.from_numpy(slots), non_blocking=True)
        self.masks.fill_decode(d.mask_buffers, seqs, rows)

    def decode_masks(self, rows: int) -> dict:
        if rows not in self._decode_masks:
            self._decode_masks[rows] = self.masks.block_masks(self.decode_in.mask_buffers, rows)
        return self._decode_masks[rows]

    def decode_forward(self, rows: int) -> torch.Tensor:
        d = self.decode_in
        return self.forward(
            d.input_ids[:rows], d.positions[:rows], d.slots[:rows], self.decode_masks(rows), None, decode=True
        )

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs.run(seqs)
        self.fill_decode(seqs, len(seqs))
        return self.decode_forward(len(seqs))
