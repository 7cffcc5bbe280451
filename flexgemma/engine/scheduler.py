"""Continuous batching: admission, chunked prefill, preemption. Decides; holds no tensors.

Each step is either a packed prefill (chunks of requests whose prompt lacks KV, at most
`max_prefill_tokens` tokens in all) or a decode (one token for every running request). Prefill
comes first whenever a request can be admitted or continued, so the batch refills as soon as
pages free up. When decode needs a page and none is free, the most recently admitted request is
preempted: its pages are freed and it waits at the head of the queue to be recomputed from
prompt + generated tokens, which it keeps. After every step, sliding-window pages that no later
query of a request can see go back to the free list (`reclaim`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from flexgemma.engine.kv_cache import KVCache
from flexgemma.engine.sequence import Sequence, Status


@dataclass
class StepPlan:
    kind: str  # "prefill" | "decode"
    seqs: list[Sequence]
    chunk_lens: list[int] = field(default_factory=list)  # prefill: tokens computed per sequence

    @property
    def num_tokens(self) -> int:
        return sum(self.chunk_lens) if self.kind == "prefill" else len(self.seqs)

    def samples(self, i: int) -> bool:
        """Does sequence i get a new token from this step?"""
        s = self.seqs[i]
        return self.kind == "decode" or s.num_computed + self.chunk_lens[i] == s.num_tokens


class Scheduler:
    def __init__(self, cache: KVCache, max_batch_size: int, max_prefill_tokens: int):
        self.cache = cache
        self.page_size = cache.page_size
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def grow(self, seq: Sequence, upto_tokens: int) -> bool:
        """Gives `seq` pages for its first `upto_tokens` positions in every page group, or nothing."""
        need = [(g, max(0, -(-upto_tokens // self.page_size) - len(g.pages_of(seq)))) for g in self.cache.page_groups]
        if any(n > g.allocator.num_free for g, n in need):
            return False
        for g, n in need:
            if n:
                pages = g.allocator.allocate(n)
                g.assign(pages, seq.seq_id, len(g.pages_of(seq)))
                g.pages_of(seq).extend(pages)
        return True

    def reclaim(self, seq: Sequence) -> None:
        """Frees the sliding-window pages no later query of `seq` can see (its next query is at
        position num_computed, and sees num_computed - window + 1 onwards)."""
        for g in self.cache.page_groups:
            if g.window is None:
                continue
            pages = g.pages_of(seq)
            keep_from = min(max(0, seq.num_computed - g.window + 1) // self.page_size, len(pages))
            old = [p for p in pages[:keep_from] if p is not None]
            if old:
                g.release(old)
                pages[:keep_from] = [None] * keep_from

    def _release_all(self, seq: Sequence) -> None:
        for g in self.cache.page_groups:
            g.release(g.pages_of(seq))
        seq.pages, seq.window_pages = [], []

    def schedule(self) -> StepPlan:
        budget = self.max_prefill_tokens
        seqs, lens = [], []
        for seq in self.running:  # chunked prompts continue first
            if budget and seq.needs_prefill:
                n = min(seq.num_tokens - seq.num_computed, budget)
                if self.grow(seq, seq.num_computed + n):
                    seqs.append(seq)
                    lens.append(n)
                    budget -= n
        while self.waiting and budget and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.grow(seq, seq.num_computed + n):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            lens.append(n)
            budget -= n
        if seqs:
            return StepPlan("prefill", seqs, lens)
        batch = self._decode_batch()
        if not batch and len(self.running) > 1:
            # every running request is a stalled chunked prefill: free the newest one's pages
            self.preempt(self.running[-1])
            return self.schedule()
        return StepPlan("decode", batch)

    def _decode_batch(self) -> list[Sequence]:
        batch = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.needs_prefill:
                continue  # preempted while making room for an earlier one, or waiting for prefill budget
            while not self.grow(seq, seq.num_tokens):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                batch.append(seq)
        return batch

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_all(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self._release_all(seq)
