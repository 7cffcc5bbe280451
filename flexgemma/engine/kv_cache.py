"""Paged KV cache: a free list of physical pages (CPU) and the physical pools (device, the
model's `KVPools`, sized here by the page groups).

A page group (ids from one allocator) indexes the pools of the layers it serves: page p of a
sequence holds that sequence's tokens [p*P, (p+1)*P) in each of them. Pools are shaped by their
layer's KV (sliding layers head_dim 256, full-attention layers 512, with their own KV head
counts). KV-shared layers own nothing: they read their source layer's pool.

Page 0 is never handed out: padded rows (CUDA-graph buckets, prefill padding) write there.
A small device tensor gives every page the logical position of its first slot, for the attention
masks (written on the host as pages are handed out, uploaded with the next step's inputs: a direct
write from pageable memory waits for the step in flight, a stall at almost every decode step); which
pages a query may read comes from its sequence's page table (pages may be shared by sequences with a
common prefix, engine/prefix_cache.py).

Sliding-window layers may keep pages of their own (`kv.reclaim_sliding`): then a sequence holds
only the pages its window can still see, and 26B-A4B's 25 sliding layers (~90% of its KV bytes
per token) stop growing with the sequence.

26B-A4B's full-attention layers have keys equal values only before their norms: K is
RoPE(k_norm(x W_k)) (a learned scale, RoPE on a quarter of the dims), V is the scale-free norm of
the same x W_k. Storing that projection once would need K rebuilt from it inside the attention
kernel, and flex_attention reads K and V as stored tensors (score_mod sees scores, not keys), so
these layers keep two pools (they are ~9% of 26B-A4B's KV bytes per token: one pool would save ~4.5%).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from flexgemma.engine.staged import Staged
from flexgemma.engine.vmm import VirtualBuffer
from flexgemma.model.kv_pools import KVPools
from flexgemma.model.spec import ModelSpec

SINK_PAGE = 0


@dataclass(frozen=True)
class PoolDemand:
    """The most a job asks of the KV pool at once: `seqs` sequences of up to `tokens` tokens each
    (None: as many as the engine's limits allow). A pool bigger than that is memory no step can use."""

    seqs: Optional[int] = None
    tokens: Optional[int] = None


class PageAllocator:
    """Hands out physical page ids and counts the sequences holding each; knows nothing about tensors.

    A page the prefix cache holds (`mark_cached`) is not freed when its last holder releases it: it
    becomes idle, and is handed out again (least recently released first, `on_evict` telling the
    cache) only when no free page is left. `num_free` counts free and idle pages alike."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (got {num_pages})")
        self.num_pages = num_pages
        self._free = deque(range(1, num_pages))
        self.refs = [0] * num_pages  # sequences holding each page
        self._cached: set[int] = set()
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages no sequence holds, LRU first
        self.num_shared = 0  # pages held by more than one sequence
        self.on_evict: Optional[Callable[[int], None]] = None  # the prefix cache forgets a reused page

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._idle)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV pages, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:  # evict the least recently used idle cached page
                page, _ = self._idle.popitem(last=False)
                self._cached.discard(page)
                if self.on_evict is not None:
                    self.on_evict(page)
            self.refs[page] = 1
            out.append(page)
        return out

    def share(self, pages: list[int]) -> None:
        """One more sequence holds each of `pages` (cached pages it starts from)."""
        for page in pages:
            if self.refs[page] == 0:
                del self._idle[page]
            self.refs[page] += 1
            self.num_shared += self.refs[page] == 2

    def release(self, pages: list[int]) -> None:
        for page in pages:
            if self.refs[page] <= 0:
                raise RuntimeError(f"KV page {page} released more often than it was handed out")
            self.refs[page] -= 1
            self.num_shared -= self.refs[page] == 1
            if self.refs[page] == 0:
                if page in self._cached:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    def mark_cached(self, page: int) -> None:
        self._cached.add(page)

    def unmark_cached(self, page: int) -> None:
        """The cache forgets `page`: if nobody holds it, it is free again."""
        self._cached.discard(page)
        if page in self._idle:
            del self._idle[page]
            self._free.append(page)

    def free_all(self) -> None:
        """Every page free again, in id order (after the engine aborted every sequence)."""
        self._free = deque(range(1, self.num_pages))
        self.refs = [0] * self.num_pages
        self._cached.clear()
        self._idle.clear()
        self.num_shared = 0

    def reset_order(self) -> None:
        """With every page free: hand them out in id order again. The same requests on an idle
        engine then land on the same pages whatever ran before (the CPU's dense attention sums
        over the pool in page order, so placement reaches the last bits of its results)."""
        if len(self._free) == self.num_pages - 1:
            self._free = deque(range(1, self.num_pages))


class PageGroup:
    """Pages of one kind: ids from an allocator, and per page the logical position of its first
    slot, on the device, for the masks (which page belongs to which sequence is in the sequences'
    page tables, which the masks read too: a page may be shared by several).

    With `window` set the group serves sliding layers only: a sequence keeps just the pages its
    next queries can see, and older entries of its list are None (freed)."""

    def __init__(self, name: str, num_pages: int, page_size: int, device: torch.device, window: Optional[int] = None):
        self.name, self.num_pages, self.page_size, self.window = name, num_pages, page_size, window
        self.allocator = PageAllocator(num_pages)
        self._pos = Staged((num_pages,), torch.int32, device)
        self.pos = self._pos.dev  # the masks read this tensor (captured graphs too): updated in place
        self._pos_dirty = False
        self.peak_in_use = 0

    def pages_of(self, seq) -> list:
        return seq.window_pages if self.window is not None else seq.pages

    @property
    def in_use(self) -> int:
        """Pages some sequence holds (a shared page counts once; idle cached pages do not count)."""
        return self.num_pages - 1 - self.allocator.num_free

    def assign(self, pages: list[int], first_logical_page: int) -> None:
        """Record the logical positions of freshly allocated pages (masks read these once
        upload_positions has run, before the next step)."""
        if not pages:
            return
        self._pos.begin_write()  # the last upload has read the mirror (it ran before the step in flight)
        self._pos.np[pages] = (np.arange(len(pages), dtype=np.int32) + first_logical_page) * self.page_size
        self._pos_dirty = True
        self.peak_in_use = max(self.peak_in_use, self.in_use)

    def upload_positions(self) -> None:
        """Queues the copy of the positions recorded since the last step (a step's inputs call this)."""
        if self._pos_dirty:
            self._pos.upload()
            self._pos_dirty = False

    def share(self, pages: list[int]) -> None:
        """A sequence starts from these cached pages (their positions are already recorded)."""
        self.allocator.share(pages)
        self.peak_in_use = max(self.peak_in_use, self.in_use)

    def release(self, pages: list) -> None:
        pages = [p for p in pages if p is not None]
        if pages:
            self.allocator.release(pages)

    def free_all(self) -> None:
        """Every page free: the engine holds no sequence any more (an abort)."""
        self.allocator.free_all()


class KVCache:
    """The page groups, and the K and V pools of every KV-writing layer (`pools`) that they index.

    Without `window_pages` one page group serves every layer. With it, sliding layers get a group
    of their own with that many pages, and keep only the pages inside their window."""

    def __init__(self, spec: ModelSpec, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device,
                 window_pages: Optional[int] = None, sleep_mode: bool = False):
        self.spec, self.page_size, self.device = spec, page_size, device
        full = PageGroup("all" if window_pages is None else "full", num_pages, page_size, device)
        self.group_for: dict[str, PageGroup] = {t: full for t in spec.layer_types}
        if window_pages is not None:
            windows = {s.window for s in spec.layers if s.window is not None}
            if len(windows) != 1:
                raise ValueError(f"page reclaiming needs one sliding window, the model has {sorted(windows)}")
            window_group = PageGroup("window", window_pages, page_size, device, window=windows.pop())
            self.group_for.update({s.layer_type: window_group for s in spec.layers if s.window is not None})
        self.page_groups = list({id(g): g for g in self.group_for.values()}.values())
        # the K/V tensors the forward writes and reads: each layer type's pools have a slot per
        # slot of its page group
        slots = {t: g.num_pages * page_size for t, g in self.group_for.items()}
        # sleep_mode on a GPU: the pools live in one VirtualBuffer, so sleep() can give their memory
        # back and wake() map it again at the same addresses (the decode graphs stay valid)
        self.virtual: Optional[VirtualBuffer] = None
        empty = None
        if sleep_mode and device.type == "cuda":
            self.virtual = VirtualBuffer(KVPools.bytes_needed(spec, slots, dtype), device)
            empty = lambda shape: self.virtual.tensor(shape, dtype)  # noqa: E731
        self.pools = KVPools(spec, slots, page_size, dtype, device, empty)

    @property
    def num_pages(self) -> int:
        """Pages of the group that holds every position (the full-attention layers')."""
        return self.page_groups[0].num_pages

    @property
    def window_group(self) -> Optional[PageGroup]:
        """The sliding layers' own page group, when they have one."""
        return next((g for g in self.page_groups if g.window is not None), None)

    @staticmethod
    def page_bytes(spec: ModelSpec, page_size: int, dtype: torch.dtype, layer_types=None) -> int:
        return spec.kv_bytes_per_token(torch.finfo(dtype).bits // 8, layer_types) * page_size

    def group_page_bytes(self, group: PageGroup) -> int:
        """Bytes one page of `group` holds over every KV-writing layer it serves."""
        return sum(2 * s.num_kv_heads * s.head_dim * self.page_size * self.pools.layer_kv(s.index)[0].element_size()
                   for s in self.spec.kv_layers if self.group_for[s.layer_type] is group)

    @property
    def nbytes(self) -> int:
        return self.pools.nbytes

    # the pools' own reads and writes, for callers that hold the cache (tests, profiling)
    def layer_kv(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pools.layer_kv(layer_index)

    def write(self, layer_index: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.pools.write(layer_index, k, v, slots)

    def upload_positions(self) -> None:
        """Every group's newly recorded page positions, queued before the step that reads them."""
        for g in self.page_groups:
            g.upload_positions()

    def copy_pages(self, copies: list[tuple[str, int, int]]) -> None:
        """(page group name, source page, destination page): every slot of each source page copied
        to its destination in every KV-writing layer the group serves (a prefill's copy-on-write)."""
        p = self.page_size
        for g in self.page_groups:
            pairs = [(src, dst) for name, src, dst in copies if name == g.name]
            if not pairs:
                continue
            offs = torch.arange(p)
            src = torch.cat([s * p + offs for s, _ in pairs]).to(self.device)
            dst = torch.cat([d * p + offs for _, d in pairs]).to(self.device)
            for s in self.spec.kv_layers:
                if self.group_for[s.layer_type] is g:
                    self.pools.copy_slots(s.index, src, dst)

    def slot(self, group: PageGroup, seq, pos: int) -> int:
        return group.pages_of(seq)[pos // self.page_size] * self.page_size + pos % self.page_size

    def slots(self, group: PageGroup, seq, positions: np.ndarray) -> np.ndarray:
        """int64 flat slots of seq's tokens at `positions` in `group` (their pages must be held)."""
        pages = np.asarray([-1 if p is None else p for p in group.pages_of(seq)], dtype=np.int64)[positions // self.page_size]
        if (pages < 0).any():
            raise RuntimeError(f"sequence {seq.seq_id}: a page of positions {positions[0]}..{positions[-1]} in page "
                               f"group {group.name} was given back")
        return pages * self.page_size + positions % self.page_size
