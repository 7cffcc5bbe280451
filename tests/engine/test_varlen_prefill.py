"""kernels.prefill_attention=varlen: prefill steps as packed variable-length attention over keys read
by slot (FlashAttention on a GPU, the same mask through SDPA on the CPU) on the layers of head_dim <= 256;
wider heads keep flex. The same tokens as flex."""

import math

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from flexgemma import ConfigError, SamplingParams, compose
from flexgemma.config.kernels import Kernels
from flexgemma.engine.block_mask import MaskBuilder
from flexgemma.engine.kv_cache import KVCache
from flexgemma.engine.sequence import Sequence
from flexgemma.model.attention import AttentionKernels, VarlenPrefill, check_varlen, varlen_reference
from flexgemma.model.load import text_config_from_dict
from flexgemma.model.spec import ModelSpec

from conftest import make_engine

P = 8


def chunk_reference(q, k, v, window):
    """One chunk in float64: q [nq, H, D] at positions nk-nq..nk-1, k/v [nk, Hkv, D] at 0..nk-1."""
    nq, h, _ = q.shape
    nk = k.shape[0]
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    qpos, kpos = torch.arange(nk - nq, nk)[:, None], torch.arange(nk)[None, :]
    allowed = kpos <= qpos
    if window:
        allowed &= kpos > qpos - window
    s = torch.einsum("qhd,khd->hqk", q.double(), k).masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def layout(q_lens, k_lens, window, device="cpu"):
    cu = lambda n: torch.tensor([0] + list(n), dtype=torch.int32, device=device).cumsum(0).to(torch.int32)  # noqa: E731
    return VarlenPrefill(cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), None, window)


@pytest.mark.parametrize("window", [None, 6])
def test_varlen_reference_attends_within_each_chunk(window):
    """Chunks of fresh prompts (as many keys as queries) and chunks after cached tokens (more keys):
    each query reads its own chunk's keys up to its position, within the window."""
    torch.manual_seed(0)
    q_lens, k_lens = [5, 23, 9, 3], [5, 30, 9, 3]
    q, k, v = torch.randn(sum(q_lens), 4, 16) * 0.3, torch.randn(sum(k_lens), 1, 16), torch.randn(sum(k_lens), 1, 16)
    lay = layout(q_lens, k_lens, window)
    out = varlen_reference(q, k, v, lay)
    cq, ck = lay.cu_seqlens_q.tolist(), lay.cu_seqlens_k.tolist()
    for qa, qb, ka, kb in zip(cq, cq[1:], ck, ck[1:]):
        torch.testing.assert_close(out[qa:qb].double(), chunk_reference(q[qa:qb], k[ka:kb], v[ka:kb], window),
                                   rtol=1e-5, atol=1e-5)


def spec_with(**hf):
    cfg = dict(compose(["+model=tiny"]).model.hf_config)
    cfg.update(hf)
    return ModelSpec.from_hf_config(text_config_from_dict(cfg))


def place(cache, lens, computed):
    """Sequences on pages of their own in each page group (the window group's numbered from 20 on)."""
    seqs, page = [], 1
    for i, (n, c) in enumerate(zip(lens, computed)):
        s = Sequence(seq_id=10 + i, index=i, prompt=list(range(n)), params=SamplingParams(), seed=0)
        pages = list(range(page, page + -(-n // P)))
        page += len(pages)
        s.pages, s.window_pages, s.num_computed = pages, [p + 20 for p in pages], c
        for g in cache.page_groups:
            g.assign(g.pages_of(s), 0)
        seqs.append(s)
    return seqs, [n - c for n, c in zip(lens, computed)]


def test_mask_builder_gives_varlen_layouts_on_narrow_heads():
    """kernels.prefill_attention=varlen: a VarlenPrefill for the layer types of head_dim <= 256 whose keys
    are the slots each chunk may read (after cached tokens: from 0 on full layers, from the window's
    start on sliding ones; the padding the sink), a BlockMask for the head_dim-512 type; flex: BlockMasks."""
    spec = spec_with(global_head_dim=512, sliding_window=6)
    cache = KVCache(spec, num_pages=40, page_size=P, dtype=torch.float32, device=torch.device("cpu"))
    varlen = MaskBuilder(spec, cache, q_block_size=P, max_model_len=128, kernels=Kernels(prefill_attention="varlen"))
    seqs, chunks = place(cache, [13, 30], [0, 20])  # the second: 20 tokens cached, 10 to compute
    masks = varlen.prefill(seqs, chunks, padded_len=32)
    sliding = masks["sliding_attention"]
    assert isinstance(sliding, VarlenPrefill) and isinstance(masks["full_attention"], BlockMask)
    assert sliding.cu_seqlens_q.tolist() == [0, 13, 23, 32] and sliding.max_q == 13
    # keys: 13 of the first; positions 15..29 of the second (the window of its first query, 20); 9 padding
    assert sliding.cu_seqlens_k.tolist() == [0, 13, 28, 37] and sliding.window == 6 and sliding.max_k == 15
    pages = varlen.groups["sliding_attention"].pages_of(seqs[1])  # its own pages, or the window group's
    want = [pages[p // P] * P + p % P for p in range(15, 30)]
    assert sliding.k_slots[13:28].tolist() == want and sliding.k_slots[28:].tolist() == [0] * 9
    flex = MaskBuilder(spec, cache, q_block_size=P, max_model_len=128)
    assert all(isinstance(m, BlockMask) for m in flex.prefill(seqs, chunks, padded_len=32).values())


def count_varlen_calls(monkeypatch) -> list:
    calls = []
    real = AttentionKernels.varlen_prefill

    def counted(*args):
        lay = args[-1]
        calls.append(int(lay.cu_seqlens_k[-1] - lay.cu_seqlens_q[-1]))  # keys read before the chunks' queries
        return real(*args)

    monkeypatch.setattr(AttentionKernels, "varlen_prefill", staticmethod(counted))
    return calls


def test_varlen_prefill_gives_flex_tokens(monkeypatch):
    """The tiny model (window 16), float32 on the CPU: prompts past the window, prompts split over
    steps (a chunk reads the earlier chunks' keys) and repeated prompts whose followers read a cached
    prefix: the same tokens, and logprobs to float32 rounding, as flex over the pages."""
    calls = count_varlen_calls(monkeypatch)
    g = torch.Generator().manual_seed(0)
    prompts = [[2] + torch.randint(3, 512, (n,), generator=g).tolist() for n in (6, 40, 75, 21)] * 2
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=i, ignore_eos=True) for i in range(8)]
    common = ["engine.max_prefill_tokens=96", "kv.prefix_cache=true"]
    want = make_engine(*common).generate(prompts, params)
    assert not calls
    got = make_engine(*common, "kernels.prefill_attention=varlen").generate(prompts, params)
    assert calls and max(calls) > 0, "no chunk read cached keys through varlen_prefill"
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    torch.testing.assert_close([o.logprobs for o in got], [o.logprobs for o in want], rtol=1e-4, atol=1e-4)


def test_varlen_refuses_what_flash_attention_cannot_take():
    with pytest.raises(ConfigError, match="takes bf16 or fp16.*prefill_attention=flex"):
        check_varlen(torch.device("cuda"), torch.float32, invariant=False)
    check_varlen(torch.device("cpu"), torch.float32, invariant=False)  # the CPU's SDPA path takes any dtype
    with pytest.raises(ConfigError, match="kernels.prefill_attention"):
        compose(["+model=tiny", "kernels.prefill_attention=flash"])
