"""The K and V tensors the attention writes and reads: one pair per KV-writing layer.

Each pair is [1, kv_heads, slots, head_dim] (the 1 is the batch dim flex_attention broadcasts);
a KV-shared layer reads its source layer's pair. The forward writes a token's K/V at the flat
slot the caller gives it; which slots a sequence holds (pages, allocation) is the engine's
business (engine/kv_cache.py), not the model's.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from flexgemma.model.spec import ModelSpec


class KVPools:
    """K/V tensors of every layer. `slots`: layer type -> slots of that type's pools; `block_size`:
    slots come in blocks of this many (the engine's page), and an attention tile must not span two."""

    def __init__(self, spec: ModelSpec, slots: dict[str, int], block_size: int, dtype: torch.dtype,
                 device: torch.device, empty: Optional[Callable[[tuple[int, ...]], torch.Tensor]] = None):
        """`empty(shape)`: where a K or V tensor's memory comes from (zeroed here); torch's allocator
        when not given."""
        self.spec, self.block_size = spec, block_size
        empty = empty or (lambda shape: torch.empty(shape, dtype=dtype, device=device))
        # Separate allocations per layer, not views of one tensor: inductor turns a KV write into a
        # view of a shared base into a copy of the base.
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in spec.kv_layers:
            shape = (1, layer.num_kv_heads, slots[layer.layer_type], layer.head_dim)
            self._kv[layer.index] = (empty(shape).zero_(), empty(shape).zero_())
        for layer in spec.layers:
            if not layer.writes_kv:
                self._kv[layer.index] = self._kv[layer.kv_source]

    @staticmethod
    def bytes_needed(spec: ModelSpec, slots: dict[str, int], dtype: torch.dtype) -> int:
        """Bytes of every K and V tensor, with 256-byte alignment between them (an upper bound)."""
        per = [layer.num_kv_heads * slots[layer.layer_type] * layer.head_dim * dtype.itemsize for layer in spec.kv_layers]
        return sum(2 * (n + 256) for n in per)

    @property
    def nbytes(self) -> int:
        return sum(2 * k.numel() * k.element_size() for i, (k, _) in self._kv.items() if self.spec.layers[i].writes_kv)

    def layer_kv(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) as [1, kv_heads, slots, head_dim], for the layer's own or its source's pool."""
        return self._kv[layer_index]

    def copy_slots(self, layer_index: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """K and V at flat slots `src` [N] copied to slots `dst` [N] (of a KV-writing layer)."""
        for pool in self._kv[layer_index]:
            pool.index_copy_(2, dst, pool.index_select(2, src))

    def write(self, layer_index: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] written at flat slot indices `slots` [T]."""
        kc, vc = self._kv[layer_index]
        kc.index_copy_(2, slots, k.transpose(0, 1)[None])
        vc.index_copy_(2, slots, v.transpose(0, 1)[None])
