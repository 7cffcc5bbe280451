"""The grouped expert path equals the per-expert loop reference."""

import pytest
import torch
import torch.nn.functional as F

from flexgemma.model.moe import experts_grouped, experts_loop


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_grouped_equals_loop(tokens):
    torch.manual_seed(tokens)
    e, h, i, k = 8, 32, 16, 2
    x = torch.randn(tokens, h)
    gate_up, down = torch.randn(e, 2 * i, h) * 0.1, torch.randn(e, h, i) * 0.1
    logits = torch.randn(tokens, e)
    w, idx = torch.softmax(logits, -1).topk(k, dim=-1)
    act = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
    got = experts_grouped(x, idx, w, gate_up, down, act)
    ref = experts_loop(x, idx, w, gate_up, down, act)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_loop_reference_matches_transformers_experts(tiny_moe_engine):
    layer = tiny_moe_engine.model.model.layers[0]
    torch.manual_seed(0)
    x = torch.randn(10, 64)
    _, w, idx = layer.router(x)
    with torch.no_grad():
        hf = layer.experts(x, idx, w)
    ex = layer.experts
    torch.testing.assert_close(experts_loop(x, idx, w, ex.gate_up_proj, ex.down_proj, ex.act_fn), hf)
    torch.testing.assert_close(experts_grouped(x, idx, w, ex.gate_up_proj, ex.down_proj, ex.act_fn), hf)


@pytest.mark.gpu
def test_grouped_mm_kernel_on_gpu_equals_loop():
    torch.manual_seed(0)
    e, h, i, k, t = 16, 256, 128, 4, 96
    dev = "cuda"
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    gate_up = (torch.randn(e, 2 * i, h, device=dev) * 0.05).bfloat16()
    down = (torch.randn(e, h, i, device=dev) * 0.05).bfloat16()
    w, idx = torch.softmax(torch.randn(t, e, device=dev), -1).topk(k, dim=-1)
    act = lambda z: F.gelu(z, approximate="tanh")  # noqa: E731
    got = experts_grouped(x, idx, w, gate_up, down, act).float()
    ref = experts_loop(x, idx, w, gate_up, down, act).float()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


def test_expected_distinct_experts_and_moe_roofline(tiny_moe_engine):
    from flexgemma.tasks.common import expected_distinct_experts, expert_weight_bytes, weight_bytes_per_decode_step

    # the figures for 26B-A4B: ~52 experts a layer at bs 8, ~112 at bs 32
    assert round(expected_distinct_experts(128, 8, 8)) == 52
    assert round(expected_distinct_experts(128, 8, 32)) == 112
    model = tiny_moe_engine.model
    experts = expert_weight_bytes(model)
    assert experts > 0
    full = weight_bytes_per_decode_step(model)
    cfg = model.config
    one = weight_bytes_per_decode_step(model, 1)
    assert full - one == round(experts * (1 - cfg.top_k_experts / cfg.num_experts))
    assert one < weight_bytes_per_decode_step(model, 4) < full


def test_gathered_segment_mm_equals_the_loop():
    """The capturable float32 path (a CUDA graph cannot loop over host offsets) on the CPU."""
    from flexgemma.model.moe import _segment_mm, _segment_mm_gathered

    torch.manual_seed(0)
    x, w = torch.randn(11, 8), torch.randn(5, 8, 6)
    offsets = torch.tensor([2, 2, 7, 7, 11], dtype=torch.int32)  # empty groups included
    assert torch.allclose(_segment_mm_gathered(x, w, offsets), _segment_mm(x, w, offsets), atol=1e-5)
