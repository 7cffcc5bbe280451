"""Paged attention over non-contiguous pages equals dense attention, for causal, sliding-window
and KV-shared layers, through each attention backend that runs on the CPU."""

import math

import pytest
import torch

from flexgemma.config.kernels import Kernels
from flexgemma.engine.block_mask import MaskBuilder
from flexgemma.engine.kv_cache import KVCache
from flexgemma.engine.sequence import SamplingParams, Sequence
from flexgemma.model.attention import attention_fn
from flexgemma.model.load import text_config_from_dict
from flexgemma.model.spec import ModelSpec
from flexgemma import compose

P = 8


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.from_hf_config(text_config_from_dict(dict(compose(["+model=tiny"]).model.hf_config)))


def reference(q, k, v, window):
    """q [Tq, H, D] at positions (L-Tq .. L-1), k/v [L, Hkv, D] at positions 0..L-1."""
    tq, h, d = q.shape
    L = k.shape[0]
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    qpos = torch.arange(L - tq, L)[:, None]
    kpos = torch.arange(L)[None, :]
    allowed = kpos <= qpos
    if window:
        allowed &= kpos > qpos - window
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()).masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.double())


def fill(cache, seq, layer, k, v):
    slots = torch.tensor([seq.pages[p // P] * P + p % P for p in range(k.shape[0])])
    cache.write(layer, k, v, slots)


@pytest.mark.parametrize("page_check", ["table", "owner"])
@pytest.mark.parametrize("backend", ["dense", "flex_eager"])
def test_paged_equals_dense(spec, backend, page_check):
    torch.manual_seed(0)
    cache = KVCache(spec, num_pages=40, page_size=P, dtype=torch.float32, device=torch.device("cpu"))
    masks = MaskBuilder(spec, cache, q_block_size=16, max_model_len=128, kernels=Kernels(prefill_page_check=page_check))
    attend = attention_fn(backend)
    # two sequences on deliberately scattered, interleaved pages
    lens = [37, 21]
    page_lists = [[17, 3, 29, 8, 31], [5, 22, 11]]
    seqs = []
    for i, (n, pages) in enumerate(zip(lens, page_lists)):
        s = Sequence(seq_id=10 + i, index=i, prompt=list(range(n)), params=SamplingParams(), seed=0)
        s.pages = pages
        cache.page_groups[0].assign(pages, 0)
        seqs.append(s)
    for layer_spec in spec.layers:
        if not layer_spec.writes_kv:
            continue
        hkv, d, h = layer_spec.num_kv_heads, layer_spec.head_dim, layer_spec.num_heads
        data = []
        for s, n in zip(seqs, lens):
            k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
            fill(cache, s, layer_spec.index, k, v)
            data.append((k, v))
        kc, vc = cache.layer_kv(layer_spec.index)
        # decode: one query per sequence at its last position
        for s in seqs:
            s.num_computed = s.num_tokens - 1
        buf = masks.decode_buffers(4)
        masks.fill_decode(buf, seqs, 2)
        bm = masks.block_masks(buf, 2)[layer_spec.layer_type]
        q = torch.randn(2, h, d)
        out = attend(q[:, :, None, :], kc, vc, block_mask=bm, scale=1.0, enable_gqa=True)[:, :, 0]
        for i, (k, v) in enumerate(data):
            ref = reference(q[i: i + 1], k, v, layer_spec.window)[0]
            torch.testing.assert_close(out[i].double(), ref, atol=1e-5, rtol=1e-5)
        # packed prefill: the last 13 and 9 tokens of each sequence as one query sequence
        chunk = [13, 9]
        for s, c in zip(seqs, chunk):
            s.num_computed = s.num_tokens - c
        bms = masks.prefill(seqs, chunk, padded_len=32)
        q = torch.randn(32, h, d)
        out = attend(q.transpose(0, 1)[None], kc, vc, block_mask=bms[layer_spec.layer_type], scale=1.0,
                     enable_gqa=True)[0].transpose(0, 1)
        t0 = 0
        for (k, v), c in zip(data, chunk):
            ref = reference(q[t0: t0 + c], k, v, layer_spec.window)
            torch.testing.assert_close(out[t0: t0 + c].double(), ref, atol=1e-5, rtol=1e-5)
            t0 += c
        assert torch.isfinite(out).all()  # padding rows included


def test_shared_layers_read_their_source_pool(spec):
    cache = KVCache(spec, num_pages=4, page_size=P, dtype=torch.float32, device=torch.device("cpu"))
    for s in spec.layers:
        k, v = cache.layer_kv(s.index)
        src_k, _ = cache.layer_kv(s.kv_source)
        assert k.data_ptr() == src_k.data_ptr()
        if s.writes_kv:
            assert s.kv_source == s.index
    # pools shaped per layer type: sliding (1 head x 32) and full (1 head x 64)
    assert cache.layer_kv(3)[0].shape == (1, 1, 4 * P, 64) and cache.layer_kv(0)[0].shape == (1, 1, 4 * P, 32)
    assert cache.nbytes == sum(2 * 4 * P * s.num_kv_heads * s.head_dim * 4 for s in spec.kv_layers)


def kernel_view(bm, q_len: int, kv_len: int) -> torch.Tensor:
    """[q_len, kv_len] bool: what the flex kernel lets through for `bm` (it visits only listed
    blocks; the mask_mod decides inside partial ones, a full one passes whole)."""
    qb, kb = bm.BLOCK_SIZE
    q, kv = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
    truth = bm.mask_mod(0, 0, q, kv)
    seen = torch.zeros(q_len, kv_len, dtype=torch.bool)
    lists = [(bm.kv_num_blocks, bm.kv_indices, False), (bm.full_kv_num_blocks, bm.full_kv_indices, True)]
    for nb, idx, whole in lists:
        if nb is None:
            continue
        for j in range(q_len // qb):
            for p in idx[0, 0, j, : nb[0, 0, j]].tolist():
                rows, cols = slice(j * qb, (j + 1) * qb), slice(p * kb, (p + 1) * kb)
                seen[rows, cols] = True if whole else truth[rows, cols]
    return seen, truth


def place_prefill(cache, page_lists, lens, computed):
    """Sequences on the given pages (group 0) with `computed` tokens done: (seqs, chunk lens, padded length)."""
    seqs = []
    for i, (n, pages, c) in enumerate(zip(lens, page_lists, computed)):
        s = Sequence(seq_id=10 + i, index=i, prompt=list(range(n)), params=SamplingParams(), seed=0)
        s.pages, s.num_computed = pages, c
        cache.page_groups[0].assign(pages, 0)
        seqs.append(s)
    chunk = [n - c for n, c in zip(lens, computed)]
    return seqs, chunk, -(-sum(chunk) // P) * P


def test_prefill_full_blocks_pass_the_mask_everywhere(spec):
    """Pages listed as full skip the mask_mod in the kernel: each must pass it at every query of
    its block, and partial + full together must let through exactly what the mask_mod does."""
    cache = KVCache(spec, num_pages=40, page_size=P, dtype=torch.float32, device=torch.device("cpu"))
    masks = MaskBuilder(spec, cache, q_block_size=P, max_model_len=128)
    # a long prompt (whole query blocks of one sequence), one after a cached prefix, a short one
    seqs, chunk, padded = place_prefill(cache, [[17, 3, 29, 8, 31, 2], [5, 22, 11, 9], [14]], [45, 30, 5], [0, 11, 0])
    full_pages = {}
    for layer_type, bm in masks.prefill(seqs, chunk, padded_len=padded).items():
        seen, truth = kernel_view(bm, padded, masks.kv_len[layer_type])
        real = sum(chunk)  # padding queries' rows aside
        assert torch.equal(seen[:real], truth[:real]), layer_type
        full_pages[layer_type] = int(bm.full_kv_num_blocks.sum())
        # torch 2.11's kernel reads the full list with the partial list's strides
        assert bm.full_kv_indices.shape == bm.kv_indices.shape
    assert all(n > 0 for n in full_pages.values()), full_pages  # both layer types list some
    partial_only = MaskBuilder(spec, cache, q_block_size=P, max_model_len=128,
                               kernels=Kernels(prefill_full_blocks=False))
    for bm in partial_only.prefill(seqs, chunk, padded_len=padded).values():
        assert bm.full_kv_num_blocks is None


def test_prefill_page_owners_give_the_page_tables_mask(spec):
    """kernels.prefill_page_check=owner: each page's owning row lets through exactly what the page-table
    entries do, for every query and slot of a packed prefill (pages of three sequences interleaved, one
    block of queries spanning two sequences); a step in which two rows list one page (a shared prefix)
    keeps the page-table mask_mod for that group, and still lets through the same."""
    cache = KVCache(spec, num_pages=40, page_size=P, dtype=torch.float32, device=torch.device("cpu"))
    table_masks = MaskBuilder(spec, cache, q_block_size=P, max_model_len=128)
    owner_masks = MaskBuilder(spec, cache, q_block_size=P, max_model_len=128,
                              kernels=Kernels(prefill_page_check="owner"))

    def check(seqs, chunk, padded, owner_kind: bool):
        want = table_masks.prefill(seqs, chunk, padded_len=padded)
        got = owner_masks.prefill(seqs, chunk, padded_len=padded)
        for layer_type in want:
            q, kv = torch.arange(padded)[:, None], torch.arange(table_masks.kv_len[layer_type])[None, :]
            got_mask, want_mask = got[layer_type].mask_mod(0, 0, q, kv), want[layer_type].mask_mod(0, 0, q, kv)
            assert torch.equal(got_mask, want_mask), layer_type
            assert got[layer_type].mask_mod.page_check == ("owner" if owner_kind else "table"), layer_type

    interleaved = place_prefill(cache, [[17, 3, 29, 8, 31, 2], [5, 22, 11, 9], [14]], [45, 30, 5], [0, 11, 0])
    check(*interleaved, owner_kind=True)
    # the second sequence starts from the first one's two prompt pages: shared, so the page table decides
    check(*place_prefill(cache, [[17, 3, 29, 8], [17, 3, 11]], [30, 21], [0, 16]), owner_kind=False)
