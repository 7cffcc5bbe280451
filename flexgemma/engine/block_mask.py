"""Logical attention masks (causal, sliding window, document) over physical KV pages.

flex_attention sees the whole pool as one KV sequence of num_pages * page_size slots. A query
may read a slot when the slot's page is in the query's sequence's page table at the page's logical
index (document mask: pages may be shared by sequences with a common prefix, so a page has no
single owner), the slot's logical position is not after the query's (causal) and, on sliding
layers, is less than `window` positions behind it. The BlockMask lists, per query block, only the pages that can pass, so the
kernel never touches the rest; the mask_mod decides inside those pages (and everywhere, in eager
mode, which ignores the sparsity).

All tensors a mask reads are persistent buffers of `MaskBuffers`, so a captured CUDA graph
replays with new values copied in and no new BlockMask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from flexgemma.engine.kv_cache import KVCache, PageGroup
from flexgemma.engine.sequence import Sequence
from flexgemma.engine.staged import Staged
from flexgemma.config.kernels import Kernels
from flexgemma.model.attention import FLASH_MAX_HEAD_DIM, VarlenPrefill
from flexgemma.model.invariant.attention import RowTable
from flexgemma.model.spec import ModelSpec

DECODE_Q_BLOCK = 128
NO_SEQ = -2  # the document id of padding queries: matches no page owner (free pages are -1)


def make_mask_mod(group: PageGroup, q_seq: torch.Tensor, q_pos: torch.Tensor, q_row: torch.Tensor,
                  table: torch.Tensor, window: Optional[int], owner: Optional[torch.Tensor] = None):
    """q_row: each query's row of `table` (its sequence's page table in `group`, -1 where it has no page).
    owner [pages] (kernels.prefill_page_check=owner, where no page is listed by two rows): each page's row,
    -1 for none; the check then reads an index of the slot alone, not the table's entry per query and slot
    (a load per slot of a tile instead of one per query and slot). The function's `page_check` says which."""
    page_size = group.page_size
    base = group.pos

    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // page_size
        start = base[page]
        kv_pos = start + kv_idx % page_size
        qp, qs = q_pos[b, q_idx], q_seq[b, q_idx]
        if owner is None:
            ok = table[q_row[b, q_idx], start // page_size] == page
        else:
            ok = owner[page] == q_row[b, q_idx]
        ok = ok & (kv_pos <= qp)
        if window is not None:
            ok = ok & (kv_pos > qp - window)
        # a padding query sees the sink slot, so no row is empty (dense softmax would give NaN)
        return ok | ((qs == NO_SEQ) & (kv_idx == 0))

    mask_mod.page_check = "table" if owner is None else "owner"
    return mask_mod


def page_owners(table: np.ndarray, num_pages: int) -> Optional[np.ndarray]:
    """[num_pages] int32: the row of `table` that lists each page (-1: none); None when a page is in two
    rows (a shared prefix), where only the page table says which sequences may read it."""
    rows, cols = np.nonzero(table >= 0)
    pages = table[rows, cols]
    if len(np.unique(pages)) < len(pages):
        return None
    owner = np.full(num_pages, -1, dtype=np.int32)
    owner[pages] = rows
    return owner


def page_table(group: PageGroup, seqs: list[Sequence], rows: int, width: int) -> np.ndarray:
    """[rows, width] int32: row i is seqs[i]'s pages in `group` by logical index, -1 where none
    (rows past len(seqs), pages past its length, sliding pages given back)."""
    table = np.full((rows, width), -1, dtype=np.int32)
    for i, s in enumerate(seqs):
        pages = group.pages_of(s)
        if pages:
            table[i, : len(pages)] = [-1 if p is None else p for p in pages]
    return table


def first_page(first_pos: int, window: Optional[int], page_size: int) -> int:
    """The logical index of the first page a query at first_pos (or later) may read."""
    return 0 if window is None else max(0, first_pos - window + 1) // page_size


def page_span(pages: list, first_pos: int, last_pos: int, window: Optional[int], page_size: int) -> list[int]:
    """Physical pages (of a sequence's list `pages`) that queries at [first_pos, last_pos] may read."""
    return pages[first_page(first_pos, window, page_size): last_pos // page_size + 1]


@dataclass
class MaskBuffers:
    """Device buffers a family of decode masks reads, sized for the largest batch. Every batch
    size uses leading slices of them and the same mask_mod functions, so the decode step of every
    CUDA-graph bucket reads the same tensors. All are views of one staged int32 buffer, filled on
    the host and uploaded in one copy."""

    staged: Staged
    q_seq: torch.Tensor  # [B, 1] int32 document id (sequence id) of each query
    q_pos: torch.Tensor  # [B, 1] int32 logical position of each query
    kv_num_blocks: dict[str, torch.Tensor]  # layer type -> [B, 1, 1] int32
    kv_indices: dict[str, torch.Tensor]  # layer type -> [B, 1, 1, max_pages_per_seq] int32
    tables: dict[str, torch.Tensor]  # page group name -> [B, max_pages_per_seq] int32 page tables
    mask_mods: dict[str, Callable]  # layer type -> mask_mod over q_seq / q_pos
    q_row: torch.Tensor  # [B, 1] int32: decode row b reads page-table row b
    host: dict[str, np.ndarray]  # the same fields on the host: "q_seq", "q_pos", "q_row", "nb/TYPE", "idx/TYPE", "tab/GROUP"


class MaskBuilder:
    """BlockMasks for flex_attention; with `invariant` (engine.batch_invariant) the same step described
    as `RowTable`s for the batch-invariant attention instead (page tables, each query's row and
    position): `block_masks` and `prefill` then return those."""

    def __init__(self, spec: ModelSpec, cache: KVCache, q_block_size: int, max_model_len: int,
                 kernels: Kernels = Kernels(), invariant: bool = False):
        self.spec, self.cache = spec, cache
        self.invariant, self.max_model_len = invariant, max_model_len
        # prefill masks list the pages a query block passes wholly as full blocks, read without the
        # mask_mod (kernels.prefill_full_blocks; off: every listed page partial)
        self.full_blocks = kernels.prefill_full_blocks
        self.page_check = kernels.prefill_page_check
        # kernels.prefill_attention=varlen: the layer types FlashAttention takes (head_dim <= 256), whose prefill
        # masks are VarlenPrefill layouts instead of BlockMasks
        self.varlen_types = set() if invariant or kernels.prefill_attention != "varlen" else {
            s.layer_type for s in spec.layers if s.head_dim <= FLASH_MAX_HEAD_DIM}
        self.page_size = cache.page_size
        self.q_block = q_block_size
        self.windows = {t: next(s.window for s in spec.layers if s.layer_type == t) for t in spec.layer_types}
        self.max_pages_per_seq = -(-max_model_len // self.page_size)
        self.groups = {t: cache.group_for[t] for t in self.windows}
        self.kv_len = {t: g.num_pages * self.page_size for t, g in self.groups.items()}
        self.device = cache.device

    # -- decode: one query per sequence ----------------------------------------------------------
    def decode_buffers(self, batch: int) -> MaskBuffers:
        w = self.max_pages_per_seq
        shapes = {"q_seq": (batch, 1), "q_pos": (batch, 1), "q_row": (batch, 1)}
        for t in self.windows:
            shapes[f"nb/{t}"] = (batch, 1, 1)
            shapes[f"idx/{t}"] = (batch, 1, 1, w)
        names = sorted({g.name for g in self.groups.values()})
        for name in names:
            shapes[f"tab/{name}"] = (batch, w)
        staged = Staged((sum(int(np.prod(s)) for s in shapes.values()),), torch.int32, self.device)
        dev, host, start = {}, {}, 0
        for name, shape in shapes.items():
            n = int(np.prod(shape))
            dev[name] = staged.dev[start: start + n].view(shape)
            host[name] = staged.np[start: start + n].reshape(shape)
            start += n
        host["q_seq"][:] = NO_SEQ
        host["q_row"][:, 0] = np.arange(batch)  # decode row b reads page-table row b
        for name in names:
            host[f"tab/{name}"][:] = -1
        staged.upload()
        tables = {name: dev[f"tab/{name}"] for name in names}
        return MaskBuffers(
            staged=staged,
            q_seq=dev["q_seq"],
            q_pos=dev["q_pos"],
            kv_num_blocks={t: dev[f"nb/{t}"] for t in self.windows},
            kv_indices={t: dev[f"idx/{t}"] for t in self.windows},
            tables=tables,
            mask_mods={t: make_mask_mod(self.groups[t], dev["q_seq"], dev["q_pos"], dev["q_row"],
                                        tables[self.groups[t].name], w_) for t, w_ in self.windows.items()},
            host=host,
            q_row=dev["q_row"],
        )

    def block_masks(self, buf: MaskBuffers, rows: int) -> dict[str, BlockMask]:
        """BlockMasks over the first `rows` rows of the buffers; built once per batch size (RowTables
        over the same buffers when invariant)."""
        if self.invariant:
            return {t: RowTable(buf.tables[self.groups[t].name][:rows], buf.q_row[:rows, 0], buf.q_pos[:rows, 0], w,
                                decode=True, max_len=self.max_model_len) for t, w in self.windows.items()}
        return {
            t: BlockMask.from_kv_blocks(
                buf.kv_num_blocks[t][:rows],
                buf.kv_indices[t][:rows],
                # one query row, but the Q block must be a multiple of the kernel's BLOCK_M (>= 16)
                BLOCK_SIZE=(DECODE_Q_BLOCK, self.page_size),
                mask_mod=buf.mask_mods[t],
                seq_lengths=(1, self.kv_len[t]),
                compute_q_blocks=False,
            )
            for t in self.windows
        }

    def fill_decode(self, buf: MaskBuffers, seqs: list[Sequence], rows: int) -> None:
        """Writes the decode masks of `seqs` into rows [0, rows) of `buf` (rows past len(seqs) pad)."""
        buf.staged.begin_write()
        n, width, page = len(seqs), self.max_pages_per_seq, self.page_size
        pos = np.zeros(rows, dtype=np.int64)
        q_seq = buf.host["q_seq"]
        q_seq[:rows] = NO_SEQ
        for i, s in enumerate(seqs):
            pos[i] = s.num_tokens - 1
            q_seq[i, 0] = s.seq_id
        buf.host["q_pos"][:rows, 0] = pos
        hi = pos // page
        cols = np.arange(width)[None, :]
        live = np.arange(rows) < n
        tables = {}
        for t, window in self.windows.items():
            group = self.groups[t]
            if group.name not in tables:  # one page table per group (-1: no page)
                tables[group.name] = page_table(group, seqs, rows, width)
                buf.host[f"tab/{group.name}"][:rows] = tables[group.name]
            lo = np.zeros(rows, dtype=np.int64) if window is None else np.maximum(pos - window + 1, 0) // page
            count = np.where(live, hi - lo + 1, 0)
            idx = np.take_along_axis(tables[group.name], np.minimum(lo[:, None] + cols, width - 1), axis=1)
            buf.host[f"nb/{t}"][:rows, 0, 0] = count
            buf.host[f"idx/{t}"][:rows, 0, 0] = np.where(cols < count[:, None], np.maximum(idx, 0), 0)
        buf.staged.upload()
        self.cache.upload_positions()  # positions of the pages handed out since the last step

    # -- prefill: every chunk packed into one query sequence ------------------------------------
    def prefill(self, seqs: list[Sequence], chunk_lens: list[int], padded_len: int) -> dict:
        """Layer type -> the step's BlockMask (VarlenPrefill under kernels.prefill_attention=varlen, RowTable
        when invariant)."""
        self.cache.upload_positions()
        varlen = self._varlen(seqs, chunk_lens, padded_len) if self.varlen_types else {}
        if set(varlen) == set(self.windows):
            return varlen
        qb = self.q_block
        n_blocks = padded_len // qb
        q_seq = np.full((1, padded_len), NO_SEQ, dtype=np.int32)
        q_pos = np.zeros((1, padded_len), dtype=np.int32)
        # padding queries read the last page-table row, which lists no page; a power of two of rows
        # keeps the distinct table shapes (compiled kernels) few
        table_rows = 1 << len(seqs).bit_length()
        q_row = np.full((1, padded_len), table_rows - 1, dtype=np.int32)
        segments: list[list[tuple[Sequence, int, int]]] = [[] for _ in range(n_blocks)]
        t0 = 0
        for i, (s, n) in enumerate(zip(seqs, chunk_lens)):
            p0 = s.num_computed
            q_seq[0, t0: t0 + n] = s.seq_id
            q_row[0, t0: t0 + n] = i
            q_pos[0, t0: t0 + n] = np.arange(p0, p0 + n)
            for j in range(t0 // qb, (t0 + n - 1) // qb + 1):
                a, b = max(t0, j * qb), min(t0 + n, (j + 1) * qb)
                segments[j].append((s, p0 + a - t0, p0 + b - 1 - t0))
            t0 += n
        q_seq_t = torch.from_numpy(q_seq).to(self.device)
        q_pos_t = torch.from_numpy(q_pos).to(self.device)
        q_row_t = torch.from_numpy(q_row).to(self.device)
        host_tables = {g.name: page_table(g, seqs, table_rows, self.max_pages_per_seq) for g in self.groups.values()}
        tables = {name: torch.from_numpy(t).to(self.device) for name, t in host_tables.items()}
        if self.invariant:
            # each chunk a run of one sequence's queries; the padding a run that reads no page
            segments = [(int(a), int(n)) for a, n in zip(np.cumsum([0] + list(chunk_lens[:-1])), chunk_lens)]
            if padded_len > sum(chunk_lens):
                segments.append((sum(chunk_lens), padded_len - sum(chunk_lens)))
            return {t: RowTable(tables[self.groups[t].name], q_row_t[0], q_pos_t[0], w, decode=False,
                                max_len=self.max_model_len, segments=segments) for t, w in self.windows.items()}
        masks = dict(varlen)
        owners = self._owners(host_tables)
        for t, window in self.windows.items():
            if t in masks:
                continue
            group = self.groups[t]
            mask_mod = make_mask_mod(group, q_seq_t, q_pos_t, q_row_t, tables[group.name], window, owners.get(group.name))
            partial, full = self._prefill_block_lists(group, segments, window)
            # one width for both lists: torch 2.11's flex kernel addresses the full list with the partial
            # list's strides (an illegal memory access on the H200 when they differed)
            width = 1 << max(1, max(len(x) for x in partial + full) - 1).bit_length()  # few widths: few recompiles
            nb, idx = self._block_arrays(partial, width)
            full_nb, full_idx = self._block_arrays(full, width) if self.full_blocks else (None, None)
            masks[t] = BlockMask.from_kv_blocks(
                nb, idx, full_nb, full_idx,
                BLOCK_SIZE=(qb, self.page_size),
                mask_mod=mask_mod,
                seq_lengths=(padded_len, self.kv_len[t]),
                compute_q_blocks=False,
            )
        return masks

    def _owners(self, host_tables: dict[str, np.ndarray]) -> dict[str, Optional[torch.Tensor]]:
        """Each page group's page owners on the device (kernels.prefill_page_check=owner; None where two rows
        list one page), or nothing (table)."""
        owners = {}
        if self.page_check == "owner":
            for g in self.groups.values():
                owner = page_owners(host_tables[g.name], g.num_pages)
                owners[g.name] = None if owner is None else torch.from_numpy(owner).to(self.device)
        return owners

    def _varlen(self, seqs: list[Sequence], chunk_lens: list[int], padded_len: int) -> dict[str, VarlenPrefill]:
        """kernels.prefill_attention=varlen: each chunk's keys are the slots of the positions its queries may
        read (from 0, or from the window's start before its first query, to its last query)."""
        pad = padded_len - sum(chunk_lens)
        q_lens = list(chunk_lens) + ([pad] if pad else [])
        cu_q = torch.from_numpy(np.cumsum([0] + q_lens).astype(np.int32)).to(self.device)
        out = {}
        for t in self.varlen_types:
            group, window = self.groups[t], self.windows[t]
            slots = [self.cache.slots(group, s, np.arange(0 if window is None else max(0, s.num_computed - window + 1),
                                                          s.num_computed + n))
                     for s, n in zip(seqs, chunk_lens)]
            slots += [np.zeros(pad, dtype=np.int64)] if pad else []  # the padding reads the sink slot
            k_lens = [len(x) for x in slots]
            cu_k = torch.from_numpy(np.cumsum([0] + k_lens).astype(np.int32)).to(self.device)
            out[t] = VarlenPrefill(cu_q, cu_k, max(q_lens), max(k_lens),
                                   torch.from_numpy(np.concatenate(slots)).to(self.device), window)
        return out

    def _prefill_block_lists(self, group: PageGroup, segments, window: Optional[int]):
        """Per query block, the pages its queries may read: (partial, full). A full page passes the
        mask everywhere in the block, so the kernel skips the mask_mod on it (that mask_mod gathers a
        page-table entry per query and slot, the costliest part of a prefill tile): the block's
        queries all belong to one sequence, the page lies wholly before its first query and, on
        sliding layers, wholly inside the window of its last."""
        ps, qb = self.page_size, self.q_block
        partial, full = [], []
        for seg in segments:
            # once per query block: sequences sharing prefix pages list the same page, and flex would
            # visit a listed block twice (its scores counted twice in the softmax)
            pages = list(dict.fromkeys(p for s, a, b in seg for p in page_span(group.pages_of(s), a, b, window, ps)))
            whole = set()
            if self.full_blocks and len(seg) == 1 and seg[0][2] - seg[0][1] + 1 == qb:
                s, a, b = seg[0]
                lo = first_page(a, window, ps)
                whole = {p for i, p in enumerate(page_span(group.pages_of(s), a, b, window, ps), start=lo)
                         if (i + 1) * ps - 1 <= a and (window is None or i * ps > b - window)}
            partial.append([p for p in pages if p not in whole])
            full.append([p for p in pages if p in whole])
        return partial, full

    def _block_arrays(self, lists: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_num_blocks [1, 1, n] and kv_indices [1, 1, n, width] on the device."""
        nb = np.zeros((1, 1, len(lists)), dtype=np.int32)
        idx = np.zeros((1, 1, len(lists), width), dtype=np.int32)
        for j, x in enumerate(lists):
            nb[0, 0, j] = len(x)
            idx[0, 0, j, : len(x)] = x
        return torch.from_numpy(nb).to(self.device), torch.from_numpy(idx).to(self.device)
