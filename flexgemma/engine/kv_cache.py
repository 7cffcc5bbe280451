"""Paged KV cache: a free list of physical pages (CPU) and the physical pools (device).

One page table serves every layer: page p of a sequence holds that sequence's tokens
[p*P, (p+1)*P) in every KV-writing layer. Pools are shaped by their layer's KV (sliding layers
head_dim 256, full-attention layers 512, with their own KV head counts). KV-shared layers own
nothing: they read their source layer's pool.

Page 0 is never handed out: padded rows (CUDA-graph buckets, prefill padding) write there.
Two small device tensors describe every page for the attention masks: its owner (a sequence id,
-1 when free) and the logical position of its first slot.
"""

from __future__ import annotations

from collections import deque

import torch

from flexgemma.model.spec import ModelSpec

SINK_PAGE = 0
NO_OWNER = -1


class PageAllocator:
    """Hands out physical page ids; knows nothing about tensors."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (got {num_pages})")
        self.num_pages = num_pages
        self._free = deque(range(1, num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV pages, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(pages)


class KVCache:
    def __init__(self, spec: ModelSpec, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        self.spec, self.num_pages, self.page_size = spec, num_pages, page_size
        self.allocator = PageAllocator(num_pages)
        slots = num_pages * page_size
        # groups: KV shape (heads, head_dim) -> the layers whose pools have that shape
        self.groups: dict[tuple[int, int], list[int]] = {}
        for layer in spec.kv_layers:
            self.groups.setdefault(layer.cache_group, []).append(layer.index)
        # Each writing layer owns separate K and V tensors [1, kv_heads, slots, head_dim] (the 1 is
        # the batch dim flex_attention broadcasts). Separate allocations, not views of one group
        # tensor: inductor turns a KV write into a view of a shared base into a copy of the base.
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in spec.kv_layers:
            shape = (1, layer.num_kv_heads, slots, layer.head_dim)
            self._kv[layer.index] = (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
        for layer in spec.layers:
            if not layer.writes_kv:
                self._kv[layer.index] = self._kv[layer.kv_source]
        self.page_owner = torch.full((num_pages,), NO_OWNER, dtype=torch.int32, device=device)
        self.page_pos = torch.zeros(num_pages, dtype=torch.int32, device=device)

    @staticmethod
    def page_bytes(spec: ModelSpec, page_size: int, dtype: torch.dtype) -> int:
        return spec.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * page_size

    @property
    def nbytes(self) -> int:
        return sum(2 * k.numel() * k.element_size() for i, (k, _) in self._kv.items() if self.spec.layers[i].writes_kv)

    def layer_kv(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) as [1, kv_heads, slots, head_dim] views, for the layer's own or its source's pool."""
        return self._kv[layer_index]

    def write(self, layer_index: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] written at flat slot indices `slots` [T]."""
        kc, vc = self._kv[layer_index]
        kc.index_copy_(2, slots, k.transpose(0, 1)[None])
        vc.index_copy_(2, slots, v.transpose(0, 1)[None])

    def assign_pages(self, pages: list[int], owner: int, first_logical_page: int) -> None:
        """Record ownership and logical positions of freshly allocated pages (masks read these)."""
        if not pages:
            return
        idx = torch.tensor(pages, dtype=torch.long)
        pos = (torch.arange(len(pages), dtype=torch.int32) + first_logical_page) * self.page_size
        self.page_owner[idx.to(self.page_owner.device)] = owner
        self.page_pos[idx.to(self.page_pos.device)] = pos.to(self.page_pos.device)

    def release_pages(self, pages: list[int]) -> None:
        if not pages:
            return
        # a freed page must stop matching its old owner: eager flex_attention evaluates the mask
        # over every slot, and a preempted sequence comes back under the same id.
        self.page_owner[torch.tensor(pages, dtype=torch.long).to(self.page_owner.device)] = NO_OWNER
        self.allocator.release(pages)
