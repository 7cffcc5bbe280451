"""Fused q/k/v and gate/up projections: one tensor is the storage of every module's weight."""

import torch

from flexgemma import SamplingParams
from flexgemma.model.projections import FusedLinear

from conftest import make_engine


def test_fused_projections_share_storage_and_keep_tokens():
    fused, plain = make_engine(), make_engine("kernels.fuse_projections=false")
    # tiny: 4 KV-writing layers fuse q/k/v (the 4 KV-shared ones have q only), 8 layers fuse gate/up
    assert fused.info["fused_projections"] == 12 and "fused_projections" not in plain.info
    layer = fused.model.model.layers[0]
    qkv = layer.self_attn.fused_qkv
    assert layer.self_attn.q_proj.weight.data_ptr() == qkv.data_ptr()
    assert layer.self_attn.v_proj.weight.data_ptr() == qkv[-layer.self_attn.v_proj.weight.shape[0]:].data_ptr()
    forward = fused.runner.forward
    assert forward.attn[0].project_qkv.weight is qkv and forward.project[0]["gate_up"].weight is layer.mlp.fused_gate_up
    assert not isinstance(forward.attn[5].project_qkv, FusedLinear)  # KV-shared: nothing to fuse with q
    assert not any(isinstance(f, FusedLinear) for a in plain.runner.forward.attn for f in (a.project_qkv, a.project_o))
    for name, p in plain.model.named_parameters():
        torch.testing.assert_close(dict(fused.model.named_parameters())[name], p, rtol=0, atol=0)
    prompts = [[2, 10, 11, 12], [2] + list(range(100, 141))]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in fused.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]


def test_keys_equal_values_layers_fuse_q_and_k():
    engine = make_engine(model="tiny_moe")
    full = engine.model.model.layers[2].self_attn  # a full-attention layer: no v_proj
    assert full.v_proj is None and full.fused_qkv.shape[0] == full.q_proj.weight.shape[0] + full.k_proj.weight.shape[0]


def test_projection_uses_a_fused_weight_only_when_it_holds_exactly_those_projections():
    from torch import nn

    from flexgemma.model.projections import _fuse, projection

    torch.manual_seed(0)
    owner = nn.Module()
    owner.q_proj, owner.k_proj, owner.v_proj = (nn.Linear(8, n, bias=False) for n in (4, 2, 2))
    names = ["q_proj", "k_proj", "v_proj"]
    owner.fused_qkv = _fuse([getattr(owner, n) for n in names])
    x = torch.randn(3, 8)
    want = [getattr(owner, n)(x) for n in names]
    whole = projection(owner, names, fused="fused_qkv")
    assert isinstance(whole, FusedLinear) and whole.weight is owner.fused_qkv
    # one GEMM over the stacked rows rounds like the three only up to the BLAS kernel's blocking
    # (exact on some CPUs, not on others): equal to float32 rounding, each output its own projection's
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(whole(x), want))
    part = projection(owner, names[:2], fused="fused_qkv")  # the fused rows hold v too: modules run
    assert not isinstance(part, FusedLinear) and all(torch.equal(a, b) for a, b in zip(part(x), want[:2]))
    owner.k_proj = type("Wrapped", (nn.Linear,), {})(8, 2, bias=False)  # no longer a plain Linear: modules run
    assert not isinstance(projection(owner, names, fused="fused_qkv"), FusedLinear)
