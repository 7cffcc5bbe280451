"""Step plan -> input tensors -> forward -> sampled tokens.

Decode reads persistent buffers sized for the largest batch (`DecodeInputs`); a step of n rows
uses their leading slices. The same decode step runs eagerly or captured in a CUDA graph per
batch bucket (cuda_graphs.py), so both read the same tensors. The runner computes; the scheduler
decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from flexgemma.engine.block_mask import MaskBuilder
from flexgemma.engine.kv_cache import SINK_PAGE, KVCache
from flexgemma.engine.sampler import SamplingBatch, sample
from flexgemma.engine.scheduler import StepPlan
from flexgemma.engine.sequence import Sequence
from flexgemma.engine.staged import Staged
from flexgemma.config.kernels import Kernels
from flexgemma.model.forward import GemmaForward


class DecodeInputs:
    """Everything a decode step reads, as persistent device buffers of `max_batch` rows."""

    INTS = ("input_ids", "positions", "slots", "window_slots", "top_k", "seed")
    FLOATS = ("temperature", "top_p")

    def __init__(self, masks: MaskBuilder, max_batch: int, device: torch.device):
        self.ints = Staged((len(self.INTS), max_batch), torch.long, device)
        self.floats = Staged((len(self.FLOATS), max_batch), torch.float32, device)
        for i, name in enumerate(self.INTS):
            setattr(self, name, self.ints.dev[i])
        for i, name in enumerate(self.FLOATS):
            setattr(self, name, self.floats.dev[i])
        self.mask_buffers = masks.decode_buffers(max_batch)


def needs_filter(seqs: list[Sequence]) -> bool:
    """Some request samples with top-k or top-p (the only case that sorts the vocabulary)."""
    return any(s.params.temperature > 0 and (s.params.top_k > 0 or s.params.top_p < 1) for s in seqs)


def greedy_only(seqs: list[Sequence]) -> bool:
    return all(s.params.temperature == 0 for s in seqs)


def sampling_arrays(seqs: list[Sequence]):
    """Per-request sampling parameters as arrays: temperature, top_k, top_p, seed."""
    return (np.array([s.params.temperature for s in seqs], dtype=np.float32),
            np.array([s.params.top_k for s in seqs], dtype=np.int64),
            np.array([s.params.top_p for s in seqs], dtype=np.float32),
            np.array([s.seed for s in seqs], dtype=np.int64))


def decode_step(forward: GemmaForward, sample_fn, input_ids, positions, slots, masks, temperature, top_k, top_p,
                seed, greedy_only: bool):
    """One decode step of B rows: the head's output (logits before the soft-cap), the (unfiltered)
    sample and, for MoE models, the rows' routed experts (else None), all on the device."""
    head = forward(input_ids, positions, slots, masks, None, decode=True)
    batch = SamplingBatch(temperature, top_k, top_p, seed, positions + 1, needs_filter=False,
                          greedy_only=greedy_only)
    tokens, logprobs = sample_fn(head, batch, forward.spec.softcap)
    return head, tokens, logprobs, forward.routing


def host_rows(routing: Optional[torch.Tensor]) -> Optional[list]:
    """A step's routed experts as one uint8 [MoE layers, top-k] array a row (None without MoE)."""
    return None if routing is None else list(routing.cpu().numpy())


class ModelRunner:
    def __init__(self, forward: GemmaForward, cache: KVCache, masks: MaskBuilder, max_batch: int, q_block: int,
                 sample_fn: Optional[Callable] = None, kernels: Kernels = Kernels()):
        self.forward, self.cache, self.masks, self.kernels = forward, cache, masks, kernels
        self.device = cache.device
        self.q_block = q_block
        self.page_size = cache.page_size
        self.max_batch = max_batch
        self.decode_in = DecodeInputs(masks, max_batch, self.device)
        self._decode_masks: dict[int, dict] = {}  # rows -> BlockMasks over the persistent buffers
        self.sample_fn = sample_fn or sample  # the sampler, compiled on the GPU
        self.graphs = None  # a cuda_graphs.DecodeGraphs once captured
        self.invariant = forward.invariant is not None  # engine.batch_invariant
        self.min_decode_rows = 1  # a decode step runs at least this many rows (the builder sets it)

    def _slots_by_type(self, slots: torch.Tensor, window_slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each layer type writes its KV at the slots of its own page group."""
        return {t: window_slots if g.window is not None else slots for t, g in self.cache.group_for.items()}

    def _to_dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[list[int], list[float], Optional[list]]:
        """Runs one step; returns the sampled token, logprob and routed experts (MoE models, else None) of
        each sequence that samples."""
        if plan.kind == "decode":
            tokens, logprobs, routing, _ = self._decode(plan.seqs)
            return tokens.tolist(), logprobs.tolist(), host_rows(routing)
        if plan.copies:  # last prompt pages copied from the request that computed them, before reads
            self.cache.copy_pages(plan.copies)
        head, sampled, positions = self._prefill(plan)
        routing = self.forward.routing
        seqs = [s for s, smp in zip(plan.seqs, sampled) if smp]
        if not seqs:
            return [], [], None
        temp, top_k, top_p, seed = sampling_arrays(seqs)
        batch = SamplingBatch(self._to_dev(temp), self._to_dev(top_k), self._to_dev(top_p), self._to_dev(seed),
                              self._to_dev(np.asarray(positions, dtype=np.int64)), needs_filter(seqs),
                              greedy_only=greedy_only(seqs))
        tokens, logprobs = self.sample_fn(head, batch, self.forward.spec.softcap)
        return tokens.tolist(), logprobs.tolist(), host_rows(routing)

    @torch.inference_mode()
    def prefill_hidden(self, plan: StepPlan, rows: list[int]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Runs a prefill step (KV written as usual) and returns the final hidden states of the step's
        token rows `rows` (indices into the packed chunks, in plan order; forward.head() makes them the
        head's output) and their routed experts (MoE models, else None): engine.score's teacher-forced
        forward, which takes the head in parts of rows."""
        return self._prefill(plan, rows, head=False)[0], self.forward.routing

    def _prefill(self, plan: StepPlan, rows: Optional[list[int]] = None, head: bool = True):
        total = plan.num_tokens
        padded = -(-total // self.q_block) * self.q_block
        ids = np.zeros(padded, dtype=np.int64)
        pos = np.zeros(padded, dtype=np.int64)
        sink = SINK_PAGE * self.page_size
        slots = np.full(padded, sink, dtype=np.int64)
        window_slots = np.full(padded, sink, dtype=np.int64)
        full, wg = self.cache.page_groups[0], self.cache.window_group
        last, sampled, draw_pos = [], [], []
        t = 0
        for s, n in zip(plan.seqs, plan.chunk_lens):
            p0 = s.num_computed
            ids[t: t + n] = s.tokens[p0: p0 + n]
            p = np.arange(p0, p0 + n)
            pos[t: t + n] = p
            slots[t: t + n] = self.cache.slots(full, s, p)
            if wg is not None:  # the chunk's window pages all exist: none is reclaimed before its queries
                window_slots[t: t + n] = self.cache.slots(wg, s, p)
            smp = p0 + n == s.num_tokens
            sampled.append(smp)
            if smp:
                last.append(t + n - 1)
                draw_pos.append(p0 + n)
            t += n
        masks = self.masks.prefill(plan.seqs, plan.chunk_lens, padded)
        index = self._to_dev(np.asarray(last if rows is None else rows, dtype=np.int64))
        slot_map = self._slots_by_type(self._to_dev(slots), self._to_dev(window_slots))
        out = self.forward(self._to_dev(ids), self._to_dev(pos), slot_map, masks, index, decode=False, head=head)
        return out, sampled, draw_pos

    # -- decode -----------------------------------------------------------------------------------
    def fill_decode(self, seqs: list[Sequence], rows: int) -> tuple[bool, bool]:
        """Writes the step's values into the persistent decode buffers (rows past len(seqs) pad).
        Returns (some row needs top-k / top-p filtering, every row is greedy)."""
        d = self.decode_in
        d.ints.begin_write()
        d.floats.begin_write()
        ints, floats = d.ints.np, d.floats.np
        ints[:, :rows] = 0
        ints[2:4, :rows] = SINK_PAGE * self.page_size  # padding rows write their KV to the sink page
        full = self.cache.page_groups[0]
        window = self.cache.window_group or full
        floats[0, :rows], floats[1, :rows] = 0.0, 1.0  # padding rows are greedy
        for i, s in enumerate(seqs):
            p = s.num_tokens - 1
            ints[:, i] = (s.last_token, p, self.cache.slot(full, s, p), self.cache.slot(window, s, p),
                          s.params.top_k, s.seed)
            floats[:, i] = (s.params.temperature, s.params.top_p)
        d.ints.upload()
        d.floats.upload()
        # masks cover the rows attention runs at (its padding rows too)
        self.masks.fill_decode(d.mask_buffers, seqs, self.kernels.padded_rows(rows))
        return needs_filter(seqs), greedy_only(seqs)

    def decode_masks(self, rows: int) -> dict:
        if rows not in self._decode_masks:
            self._decode_masks[rows] = self.masks.block_masks(self.decode_in.mask_buffers, rows)
        return self._decode_masks[rows]

    def decode_step(self, rows: int, greedy_only: bool = False):
        d = self.decode_in
        return decode_step(
            self.forward, self.sample_fn, d.input_ids[:rows], d.positions[:rows],
            self._slots_by_type(d.slots[:rows], d.window_slots[:rows]),
            self.decode_masks(self.kernels.padded_rows(rows)), d.temperature[:rows], d.top_k[:rows], d.top_p[:rows],
            d.seed[:rows], greedy_only,
        )

    def _decode(self, seqs: list[Sequence], chained: Optional["DecodeLaunch"] = None, timed: bool = False):
        """(tokens, logprobs, events): events are (start, end) around the step on the GPU when `timed`
        (async decode reads them once the step has passed), else None."""
        n = len(seqs)
        rows = self.graphs.bucket_for(n) if self.graphs is not None else max(n, self.min_decode_rows)
        filtered, greedy = self.fill_decode(seqs, rows)
        if chained is not None:  # the input tokens are the previous step's, still on the device
            self.decode_in.input_ids[:n].copy_(chained.tokens)
        start = self._event() if timed else None
        if self.graphs is not None:
            head, tokens, logprobs, routing = self.graphs.replay(rows, n, greedy)
        else:
            head, tokens, logprobs, routing = self.decode_step(rows, greedy)
        events = (start, self._event()) if start is not None else None
        routing = routing[:n] if routing is not None else None
        if filtered:  # top-k / top-p sort the vocabulary: only for batches that ask for it
            d = self.decode_in
            batch = SamplingBatch(d.temperature[:n], d.top_k[:n], d.top_p[:n], d.seed[:n], d.positions[:n] + 1,
                                  needs_filter=True)
            return (*self.sample_fn(head[:n], batch, self.forward.spec.softcap), routing, events)
        return tokens[:n], logprobs[:n], routing, events

    def _event(self) -> Optional[torch.cuda.Event]:
        """A timing event recorded on the device's stream now (None on the CPU): around each decode
        step, the GPU's time in the step and its idle time between chained steps."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    # -- asynchronous decode: launch a step, read its tokens later ------------------------------
    @torch.inference_mode()
    def launch_decode(self, seqs: list[Sequence], chained: Optional["DecodeLaunch"] = None) -> "DecodeLaunch":
        """Queues a decode step and the copy of its tokens to the host; returns without waiting.
        With `chained`, the step's input tokens are `chained`'s (same sequences, same order), so it
        can be queued before the host has read them."""
        tokens, logprobs, routing, events = self._decode(seqs, chained, timed=True)
        if not hasattr(self, "_out_host"):  # two pinned mirrors: a step's copy never overwrites unread tokens
            pin = self.device.type == "cuda"
            self._out_host = [(torch.zeros(self.max_batch, dtype=torch.long, pin_memory=pin),
                               torch.zeros(self.max_batch, dtype=torch.float32, pin_memory=pin),
                               None if routing is None else
                               torch.zeros(self.max_batch, *routing.shape[1:], dtype=torch.uint8, pin_memory=pin))
                              for _ in range(2)]
            self._out_turn = 0
        tok_host, lp_host, routing_host = self._out_host[self._out_turn]
        self._out_turn ^= 1
        n = len(seqs)
        tok_host[:n].copy_(tokens, non_blocking=True)
        lp_host[:n].copy_(logprobs, non_blocking=True)
        if routing is not None:
            routing_host[:n].copy_(routing, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return DecodeLaunch(list(seqs), tokens, tok_host[:n], lp_host[:n], done, events,
                            host_routing=routing_host[:n] if routing is not None else None)

    @staticmethod
    def collect(launch: "DecodeLaunch") -> tuple[list[int], list[float], Optional[list]]:
        if launch.done is not None:
            launch.done.synchronize()
        routing = None if launch.host_routing is None else list(launch.host_routing.numpy().copy())
        return launch.host_tokens.tolist(), launch.host_logprobs.tolist(), routing


@dataclass
class DecodeLaunch:
    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] on the device: the next chained step's input
    host_tokens: torch.Tensor  # pinned mirrors, valid once `done` has passed
    host_logprobs: torch.Tensor
    done: Optional[torch.cuda.Event]
    events: Optional[tuple] = None  # timing events (start, end) around the step on the GPU; None on the CPU
    index: list[int] = field(default_factory=list)  # per sequence: where its token goes in `generated`
    host_routing: Optional[torch.Tensor] = None  # pinned uint8 [n, MoE layers, top-k] (MoE models)
