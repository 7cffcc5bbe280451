"""kernels.prefill_attention=varlen: a prefill step whose chunks all start at position 0 runs packed
variable-length attention over the step's own K and V (FlashAttention on a GPU, the same mask through
SDPA on the CPU); wider heads and steps with cached context keep flex. Same tokens as flex."""

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
    """One chunk in float64: q, k, v [n, H or Hkv, D] at positions 0..n-1."""
    n, h, _ = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    qpos, kpos = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = kpos <= qpos
    if window:
        allowed &= kpos > qpos - window
    s = torch.einsum("qhd,khd->hqk", q.double(), k).masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 6])
def test_varlen_reference_attends_within_each_chunk(window):
    torch.manual_seed(0)
    lens, pad = [5, 23, 9], 3
    t = sum(lens) + pad
    q, k, v = torch.randn(t, 4, 16) * 0.3, torch.randn(t, 1, 16), torch.randn(t, 1, 16)
    cu = torch.tensor([0, 5, 28, 37, 40], dtype=torch.int32)
    out = varlen_reference(q, k, v, VarlenPrefill(cu, max(lens), window))
    for a, b in zip(cu[:-2].tolist(), cu[1:-1].tolist()):
        want = chunk_reference(q[a:b], k[a:b], v[a:b], window)
        torch.testing.assert_close(out[a:b].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out[sum(lens):]).all()  # the padding a chunk of its own


def spec_with(**hf):
    cfg = dict(compose(["+model=tiny"]).model.hf_config)
    cfg.update(hf)
    return ModelSpec.from_hf_config(text_config_from_dict(cfg))


def place(cache, lens, computed, first_page=1):
    seqs, page = [], first_page
    for i, (n, c) in enumerate(zip(lens, computed)):
        s = Sequence(seq_id=10 + i, index=i, prompt=list(range(n)), params=SamplingParams(), seed=0)
        pages = list(range(page, page + -(-n // P)))
        page += len(pages)
        s.pages, s.num_computed = pages, c
        cache.page_groups[0].assign(pages, 0)
        seqs.append(s)
    return seqs, [n - c for n, c in zip(lens, computed)]


def test_mask_builder_gives_varlen_layouts_to_fresh_steps_on_narrow_heads():
    """A step of fresh chunks: a VarlenPrefill for the layer types of head_dim <= 256 (the padding one
    chunk more), a BlockMask for the head_dim-512 type; a chunk after cached tokens: BlockMasks only;
    kernels.prefill_attention=flex: BlockMasks only."""
    spec = spec_with(global_head_dim=512)
    cache = KVCache(spec, num_pages=40, page_size=P, dtype=torch.float32, device=torch.device("cpu"))
    varlen = MaskBuilder(spec, cache, q_block_size=P, max_model_len=128, kernels=Kernels(prefill_attention="varlen"))
    seqs, chunks = place(cache, [13, 30], [0, 0])
    masks = varlen.prefill(seqs, chunks, padded_len=48)
    sliding = masks["sliding_attention"]
    assert isinstance(sliding, VarlenPrefill) and isinstance(masks["full_attention"], BlockMask)
    assert sliding.cu_seqlens.tolist() == [0, 13, 43, 48] and sliding.max_len == 30
    assert sliding.window == spec.layers[0].window
    seqs[1].num_computed = 8  # its first 8 tokens cached: a chunk that must read them
    masks = varlen.prefill(seqs, [13, 22], padded_len=40)
    assert all(isinstance(m, BlockMask) for m in masks.values())
    seqs[1].num_computed = 0
    flex = MaskBuilder(spec, cache, q_block_size=P, max_model_len=128)
    assert all(isinstance(m, BlockMask) for m in flex.prefill(seqs, chunks, padded_len=48).values())


def count_varlen_calls(monkeypatch) -> list:
    calls = []
    real = AttentionKernels.varlen_prefill

    def counted(*args):
        calls.append(args[-1].cu_seqlens.numel())
        return real(*args)

    monkeypatch.setattr(AttentionKernels, "varlen_prefill", staticmethod(counted))
    return calls


def test_varlen_prefill_gives_flex_tokens(monkeypatch):
    """The tiny model (window 16), float32 on the CPU: prompts past the window, a prompt split over
    two steps (the second reads the first's pages: flex), and GRPO groups whose followers read a
    shared prefix (flex): the same tokens, and logprobs to float32 rounding, as every step through flex."""
    calls = count_varlen_calls(monkeypatch)
    g = torch.Generator().manual_seed(0)
    prompts = [[2] + torch.randint(3, 512, (n,), generator=g).tolist() for n in (6, 40, 75, 21)] * 2
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=i, ignore_eos=True) for i in range(8)]
    common = ["engine.max_prefill_tokens=96", "kv.prefix_cache=true"]
    want = make_engine(*common).generate(prompts, params)
    assert not calls
    got = make_engine(*common, "kernels.prefill_attention=varlen").generate(prompts, params)
    assert calls, "no step went through varlen_prefill"
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    torch.testing.assert_close([o.logprobs for o in got], [o.logprobs for o in want], rtol=1e-4, atol=1e-4)


def test_varlen_refuses_what_flash_attention_cannot_take():
    with pytest.raises(ConfigError, match="takes bf16 or fp16.*prefill_attention=flex"):
        check_varlen(torch.device("cuda"), torch.float32, invariant=False)
    check_varlen(torch.device("cpu"), torch.float32, invariant=False)  # the CPU's SDPA path takes any dtype
    with pytest.raises(ConfigError, match="kernels.prefill_attention"):
        compose(["+model=tiny", "kernels.prefill_attention=flash"])
