"""Paged KV cache: a free list of physical pages (CPU) and the physical pools (device).

One page table serves every layer: page p of a sequence holds that sequence's tokens
[p*P, (p+1)*P) in every KV-writing layer. Layers of the same KV shape (heads, head_dim) share
one pool tensor, so sliding (head_dim 256) and full-attention (head_dim 512) layers get pools of
their own sizes. KV-shared layers own nothing: they read their source layer's pool.

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
        members: dict[tuple[int, int], list[int]] = {}
        for layer in spec.kv_layers:
            members.setdefault(layer.cache_group, []).append(layer.index)
        # pools[group]: [n_layers, 2 (k, v), 1, kv_heads, slots, head_dim]; the leading 1 is the
        # batch dim flex_attention broadcasts over every query row.
        self.pools = {
            g: torch.zeros(len(idx), 2, 1, g[0], slots, g[1], dtype=dtype, device=device) for g, idx in members.items()
        }
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for g, idx in members.items():
            for j, i in enumerate(idx):
                self._kv[i] = (self.pools[g][j, 0], self.pools[g][j, 1])
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
        return sum(p.numel() * p.element_size() for p in self.pools.values())

    def layer_kv(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) as [1, kv_heads, slots, head_dim] views, for the layer's own or its source's pool."""
        return self._kv[layer_index]

    def write(self, layer_index: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] written at flat slot indices `slots` [T]."""
        kc, vc = self._kv[layer_index]
        kc[0].index_copy_(1, slots, k.transpose(0, 1))
        vc[0].index_copy_(1, slots, v.transpose(0, 1))

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
