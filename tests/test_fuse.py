"""Fused q/k/v and gate/up projections: one tensor is the storage of every module's weight."""

import torch

from flexgemma import SamplingParams

from conftest import make_engine


def test_fused_projections_share_storage_and_keep_tokens():
    fused, plain = make_engine(), make_engine("engine.fuse_projections=false")
    # tiny: 4 KV-writing layers fuse q/k/v (the 4 KV-shared ones have q only), 8 layers fuse gate/up
    assert fused.info["fused_projections"] == 12 and "fused_projections" not in plain.info
    layer = fused.model.model.layers[0]
    qkv = layer.self_attn.fused_qkv
    assert layer.self_attn.q_proj.weight.data_ptr() == qkv.data_ptr()
    assert layer.self_attn.v_proj.weight.data_ptr() == qkv[-layer.self_attn.v_proj.weight.shape[0]:].data_ptr()
    assert fused.runner.forward.attn[0].qkv is qkv and fused.runner.forward.gate_up[0] is layer.mlp.fused_gate_up
    assert fused.runner.forward.attn[5].qkv is None  # KV-shared: nothing to fuse with q
    for name, p in plain.model.named_parameters():
        torch.testing.assert_close(dict(fused.model.named_parameters())[name], p, rtol=0, atol=0)
    prompts = [[2, 10, 11, 12], [2] + list(range(100, 141))]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in fused.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]


def test_keys_equal_values_layers_fuse_q_and_k():
    engine = make_engine(model="tiny_moe")
    full = engine.model.model.layers[2].self_attn  # a full-attention layer: no v_proj
    assert full.v_proj is None and full.fused_qkv.shape[0] == full.q_proj.weight.shape[0] + full.k_proj.weight.shape[0]
