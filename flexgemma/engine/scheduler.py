"""Continuous batching: admission, chunked prefill, preemption. Decides; holds no tensors.

Each step is either a packed prefill (chunks of requests whose prompt lacks KV, at most
`max_prefill_tokens` tokens in all) or a decode (one token for every running request). Prefill
comes first whenever a request can be admitted or continued, so the batch refills as soon as
pages free up. When decode needs a page and none is free, the most recently admitted request is
preempted: its pages are freed and it waits at the head of the queue to be recomputed from
prompt + generated tokens, which it keeps. After every step, sliding-window pages that no later
query of a request can see go back to the free list (`reclaim`).

With a prefix cache (engine/prefix_cache.py), a request is admitted on top of the cached pages of
its prompt's leading full pages (their references taken, `num_computed` past them), and every full
prompt page a prefill computes is registered as soon as it is written. A request whose next page
is being computed right now by another request's prefill (a GRPO group: the same prompt n times)
waits for it instead of computing it again.

Sequence state (tokens, num_computed, reclaim, finish, abort) changes only here: `postprocess`
applies a step's sampled tokens; with asynchronous decode, `launched` gives the sequences of a
queued step placeholder tokens and `postprocess_launched` fills them in once read.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from flexgemma.engine.kv_cache import KVCache
from flexgemma.engine.prefix_cache import PrefixCache
from flexgemma.engine.sequence import PENDING, Sequence, Status, StopRule


@dataclass
class StepPlan:
    kind: str  # "prefill" | "decode"
    seqs: list[Sequence]
    chunk_lens: list[int] = field(default_factory=list)  # prefill: tokens computed per sequence
    # prefill: (page group, source page, destination page) to copy before the step (a copy's last page)
    copies: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.chunk_lens) if self.kind == "prefill" else len(self.seqs)

    def samples(self, i: int) -> bool:
        """Does sequence i get a new token from this step?"""
        s = self.seqs[i]
        return self.kind == "decode" or s.num_computed + self.chunk_lens[i] == s.num_tokens


class Scheduler:
    def __init__(self, cache: KVCache, max_batch_size: int, max_prefill_tokens: int, prefix_cache: bool = False):
        self.cache = cache
        self.prefix: Optional[PrefixCache] = PrefixCache(cache.page_groups, cache.page_size) if prefix_cache else None
        self.prefix_hit_tokens = 0  # prompt tokens whose KV came from the cache, since reset_peaks()
        self.shared_pages_peak = 0  # most pages held by more than one sequence at once, since reset_peaks()
        self.prompt_pages_peak: dict[str, float] = {}  # page group -> most pages holding prompt KV at once
        self.page_size = cache.page_size
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stop_rule: Optional[StopRule] = None  # set by the Engine (EOS ids, max_model_len)
        self.tokens_generated = 0  # tokens postprocess has applied, ever (progress bars read it)

    def reset_peaks(self) -> None:
        """Starts counting the most pages in use at once anew (and, on an idle pool, hands pages out
        in id order again: the same requests land on the same pages whatever ran before)."""
        for g in self.cache.page_groups:
            g.peak_in_use = g.in_use
            g.allocator.reset_order()
        self.prefix_hit_tokens = 0
        self.shared_pages_peak = self._shared_pages()
        self.prompt_pages_peak = self._prompt_pages()

    def _prompt_pages(self) -> dict[str, float]:
        """Page group -> the KV of prompt tokens that running sequences hold, in pages (a page shared by
        several sequences once; a sequence's last, partial prompt page by its prompt tokens alone, as
        its other slots hold what it generates). Sets, not a loop a page: it runs at every prefill step."""
        out, size = {}, self.page_size
        for g in self.cache.page_groups:
            full, partial = set(), 0  # a partial page is its sequence's own: never shared, counted once
            for s in self.running:
                pages, n = g.pages_of(s), len(s.prompt)
                full.update(pages[: n // size])
                if n % size and n // size < len(pages) and pages[n // size] is not None:
                    partial += n % size
            full.discard(None)
            out[g.name] = len(full) + partial / size
        return out

    def _shared_pages(self) -> int:
        return sum(g.allocator.num_shared for g in self.cache.page_groups)

    def peak_pages(self) -> dict[str, int]:
        """Page group -> the most pages in use at once since reset_peaks()."""
        return {g.name: g.peak_in_use for g in self.cache.page_groups}

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
                g.assign(pages, len(g.pages_of(seq)))
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
        if self.prefix is not None and seq.tail_name is not None:  # its last page is gone: no longer a source
            self.prefix.drop_tail(seq.tail_name[1], seq)

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
        pending = self._pending_pages() if self.waiting and len(self.running) < self.max_batch_size else set()
        copies: list[tuple[str, int, int]] = []
        i = 0
        while i < len(self.waiting) and budget and len(self.running) < self.max_batch_size:
            seq = self.waiting[i]
            hashes, cached = self._cached_prefix(seq)
            # its last page can be copied when every full page before it is a hit
            tail = self._tail_key(seq) if len(cached) == len(hashes) and self._fresh(seq) else None
            source = self._tail_source(seq, tail)
            if pending and ((len(cached) < len(hashes) and hashes[len(cached)] in pending)
                            or (source is None and tail in pending)):
                i += 1  # the next page it would compute is being computed by another request: wait
                continue
            hit = self._reuse_prefix(seq, cached)
            if source is not None:  # computes only its last token, on a copy of source's last page
                seq.num_computed, seq.kv_version = len(seq.prompt) - 1, self.prefix.version
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.grow(seq, seq.num_computed + n):
                if seq.num_computed:  # it waits holding nothing
                    self._release_all(seq)
                    seq.num_computed = 0
                break
            if source is not None:
                last = (len(seq.prompt) - 1) // self.page_size
                copies += [(g.name, g.pages_of(source)[last], g.pages_of(seq)[last]) for g in self.cache.page_groups]
                hit = seq.num_computed
            del self.waiting[i]
            self.prefix_hit_tokens += hit
            pending.update(self._pages_to_register(seq))
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            lens.append(n)
            budget -= n
        if seqs:  # prompt pages only grow at a prefill step: their peak is counted here alone
            now = self._prompt_pages()
            self.prompt_pages_peak = {k: max(n, self.prompt_pages_peak.get(k, 0)) for k, n in now.items()}
            return StepPlan("prefill", seqs, lens, copies)
        batch = self._decode_batch()
        if not batch and len(self.running) > 1:
            # every running request is a stalled chunked prefill: free the newest one's pages
            self.preempt(self.running[-1])
            return self.schedule()
        if not batch and self.has_work:
            stuck = (self.waiting or self.running)[0]
            raise RuntimeError(
                f"request {stuck.index} ({stuck.num_tokens} tokens) cannot get KV pages even with nothing else "
                f"running: the pool is too small for it (raise kv.max_pages or lower engine.max_prefill_tokens)"
            )
        return StepPlan("decode", batch)

    # -- prefix cache -------------------------------------------------------------------------------
    def _prompt_hashes(self, seq: Sequence) -> list[bytes]:
        """The hashes of seq's full prompt pages under the current weights (memoised on seq)."""
        if seq.block_hashes is None or seq.block_hashes[0] != self.prefix.version:
            seq.block_hashes = (self.prefix.version, self.prefix.hashes(seq.prompt))
        return seq.block_hashes[1]

    def _fresh(self, seq: Sequence) -> bool:
        """seq may start from cached pages: the cache is on, it is not engine.score's, holds nothing."""
        return self.prefix is not None and seq.prefix_cacheable and not seq.num_computed and not seq.pages

    def _usable_hashes(self, seq: Sequence) -> list[bytes]:
        """The full pages seq may start from: never the page of its last token, which it computes
        (to sample from) and so writes; a cached page is never written."""
        if not self._fresh(seq):
            return []
        return self._prompt_hashes(seq)[: (seq.num_tokens - 1) // self.page_size]

    def _tail_key(self, seq: Sequence) -> Optional[bytes]:
        """The name of seq's prompt's last page without its last token (memoised; None: no such
        tokens, or no prefix cache)."""
        if self.prefix is None or not seq.prefix_cacheable:
            return None
        if seq.tail_name is None or seq.tail_name[0] != self.prefix.version:
            seq.tail_name = (self.prefix.version, self.prefix.tail_key(seq.prompt, self._prompt_hashes(seq)))
        return seq.tail_name[1]

    def _tail_source(self, seq: Sequence, key: Optional[bytes]) -> Optional[Sequence]:
        """A running request that computed the last page named `key` and still holds it in every
        group (it is copied before the step reads it), or None. Sources are running requests under
        these weights (_release_all and a version bump drop them), but a sliding window may have
        given the page back. A fresh sequence with generated tokens (preempted) copies nothing."""
        if key is None or seq.generated:
            return None
        src = self.prefix.tail(key)
        last = (len(seq.prompt) - 1) // self.page_size
        if src is not None and any(g.pages_of(src)[last] is None for g in self.cache.page_groups):
            self.prefix.drop_tail(key, src)  # its window page was given back
            src = None
        return src

    def _cached_prefix(self, seq: Sequence) -> tuple[list[bytes], list]:
        """The hashes of the full pages seq may start from, and the cache entries of the longest
        cached prefix of them (both empty without a prefix cache)."""
        hashes = self._usable_hashes(seq)
        return hashes, (self.prefix.lookup(hashes) if hashes else [])

    def _reuse_prefix(self, seq: Sequence, entries: list) -> int:
        """Gives a sequence being admitted the cached pages `entries` (its longest cached prefix; one
        reference each) and counts them as computed. Returns the tokens reused."""
        k = len(entries)
        if not k:
            return 0
        seq.kv_version = self.prefix.version
        for g in self.cache.page_groups:
            lo = self.prefix.window_start(g, k)
            pages = [entries[j][g.name] for j in range(lo, k)]
            g.share(pages)
            g.pages_of(seq)[:] = [None] * lo + pages
        seq.num_computed = k * self.page_size
        self.shared_pages_peak = max(self.shared_pages_peak, self._shared_pages())
        return seq.num_computed

    def _pages_to_register(self, seq: Sequence) -> set:
        """Names of the full prompt pages, and of the last page, that seq's prefill has still to
        compute (and will register)."""
        if self.prefix is None or not seq.prefix_cacheable:
            return set()
        out = set(self._prompt_hashes(seq)[seq.num_computed // self.page_size:])
        tail = self._tail_key(seq)
        if tail is not None and seq.num_computed < len(seq.prompt) - 1:
            out.add(tail)
        return out

    def _pending_pages(self) -> set:
        """Hashes of full prompt pages that running prefills are computing now."""
        out = set()
        for s in self.running:
            if s.needs_prefill:
                out |= self._pages_to_register(s)
        return out

    def _register(self, seq: Sequence, before: int) -> None:
        """Registers the full prompt pages seq's last prefill chunk completed (tokens before..num_computed)."""
        if self.prefix is None or not seq.prefix_cacheable or seq.kv_version != self.prefix.version:
            return  # computed with older weights: never a hit
        hashes = self._prompt_hashes(seq)
        for j in range(before // self.page_size, min(seq.num_computed // self.page_size, len(hashes))):
            self.prefix.insert(hashes[j], {g.name: g.pages_of(seq)[j] for g in self.cache.page_groups})
        tail = self._tail_key(seq)
        if tail is not None and before < len(seq.prompt) <= seq.num_computed:  # this chunk ended its prompt
            self.prefix.add_tail(tail, seq)

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
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self._release_all(seq)

    # -- after a step: the only place sequence state changes ---------------------------------------
    def postprocess(self, plan: StepPlan, tokens: list[int], logprobs: list[float], now: float,
                    routed: Optional[list] = None) -> list[Sequence]:
        """Applies a step that ran to completion: its KV is computed, sampling rows get their token,
        out-of-window pages are reclaimed, and finished sequences release their pages. `now` is
        time.perf_counter() when the tokens arrived. Returns the sequences that finished."""
        finished, k, prefill = [], 0, plan.kind == "prefill"
        for i, s in enumerate(list(plan.seqs)):
            if prefill:
                samples = plan.samples(i)  # before num_computed moves
                if s.num_computed == 0 and self.prefix is not None:
                    s.kv_version = self.prefix.version  # the weights its KV is computed with
                before = s.num_computed
                s.num_computed += plan.chunk_lens[i]
                self._register(s, before)  # before reclaim: its sliding pages are registered too
                self.reclaim(s)
                if not samples:
                    continue  # a chunk of a longer prompt
            else:
                s.num_computed += 1
                self.reclaim(s)
            s.generated.append(tokens[k])
            s.logprobs.append(logprobs[k])
            if s.params.return_routed_experts:
                s.routed.append(routed[k] if routed is not None else None)
            k += 1
            if self._finish_if_done(s, len(s.generated) - 1, now):
                finished.append(s)
        self.tokens_generated += k
        return finished

    def launched(self, seqs: list[Sequence]) -> list[int]:
        """A decode step of `seqs` was queued: each gets a placeholder token (its KV counts as
        computed) until the step's tokens are read. Returns where each token goes in `generated`."""
        index = []
        for s in seqs:
            index.append(len(s.generated))
            s.generated.append(PENDING)
            s.logprobs.append(float("nan"))
            if s.params.return_routed_experts:
                s.routed.append(None)
            s.num_computed += 1
        return index

    def postprocess_launched(self, seqs: list[Sequence], index: list[int], tokens: list[int],
                             logprobs: list[float], now: float, routed: Optional[list] = None) -> list[Sequence]:
        """Fills in the placeholders of a queued decode step whose tokens were read (see `launched`)."""
        finished = []
        for r, (s, i, tok, lp) in enumerate(zip(seqs, index, tokens, logprobs)):
            if s.status is Status.FINISHED:
                continue  # finished (or aborted) before: this row was computed in vain
            s.generated[i], s.logprobs[i] = tok, lp
            if s.params.return_routed_experts:
                s.routed[i] = routed[r] if routed is not None else None
            self.tokens_generated += 1
            if self._finish_if_done(s, i, now):
                finished.append(s)
            else:
                self.reclaim(s)
        return finished

    def _finish_if_done(self, s: Sequence, i: int, now: float) -> bool:
        """After s's token i arrived: finishes s if that token stops it (dropping a queued step's
        placeholder behind it). Returns whether s finished."""
        if s.first_token_time is None:
            s.first_token_time = now - s.arrival
        if len(s.token_times) == i:  # token i's first arrival (a recomputed one after preemption keeps it)
            s.token_times.append(now - s.arrival)
        reason = self.stop_rule.reason(s, s.generated[i], count=i + 1)
        if not reason:
            return False
        del s.generated[i + 1:], s.logprobs[i + 1:], s.routed[i + 1:]
        s.finish_time = now - s.arrival
        self.finish(s, reason)
        return True

    # -- asynchronous decode: may the next step be queued before this one's tokens are read? ------
    def can_chain(self, seqs: list[Sequence]) -> bool:
        """The next step is a decode of exactly these sequences: nothing waits to be admitted or
        prefilled and none reaches a known limit with the queued token. Changes nothing."""
        if self.waiting or len(self.running) != len(seqs):
            return False
        for s in seqs:
            if s.status is not Status.RUNNING or s.needs_prefill:
                return False
            if len(s.generated) >= s.params.max_new_tokens or s.num_tokens >= self.stop_rule.max_model_len:
                return False
        return True

    def grow_for_decode(self, seqs: list[Sequence]) -> bool:
        """Gives every sequence the pages of its next decode position; False when the pool runs
        out (those already grown keep their pages: their next decode needs them anyway)."""
        return all(self.grow(s, s.num_tokens) for s in seqs)

    # -- abort ---------------------------------------------------------------------------------------
    def abort(self, seq: Sequence) -> None:
        """Stops `seq` wherever it is (waiting, running, in a queued step) and frees its pages."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        self._release_all(seq)
        self._mark_aborted(seq)

    def abort_all(self, seqs) -> None:
        """Aborts `seqs` (every sequence the engine holds) wherever a failure left them, and puts
        every page back on the free lists: with no sequence left, no page is in use."""
        for s in seqs:
            self._mark_aborted(s)
        self.waiting.clear()
        self.running.clear()
        if self.prefix is not None:
            self.prefix.clear()
        for g in self.cache.page_groups:
            g.free_all()

    @staticmethod
    def _mark_aborted(seq: Sequence) -> None:
        while seq.generated and seq.generated[-1] == PENDING:  # a queued step's token, never read
            seq.generated.pop()
            seq.logprobs.pop()
        seq.pages, seq.window_pages = [], []
        seq.status = Status.FINISHED
        seq.finish_reason = "abort"
