"""flex kernel options from the attn config, and compiled functions that belong to one engine."""

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from flexgemma import compose
from flexgemma.model.compiled import CompileCounter, compile_fn
from flexgemma.model.attention import kernel_options

from conftest import outputs_per_setting


def test_kernel_option_keys_are_the_ones_torch_reads():
    attn = compose(["+model=tiny"]).attn
    # Triton launch parameters are lower case; tile sizes upper case (a wrong case is silently ignored)
    assert kernel_options(attn.decode, 512, 64) == {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    assert kernel_options(attn.decode, 256, 64) == {"BLOCK_N": 32}  # the H200 sweep's best
    assert kernel_options(attn.prefill, 512, 64) == {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 2}
    assert kernel_options(attn.prefill, 256, 64) == {"BLOCK_N": 64}  # torch's own choice, capped at the page
    assert kernel_options(attn.prefill, 256, 16) == {"BLOCK_N": 16}


def test_float32_tiles_fit_shared_memory():
    attn = compose(["+model=tiny"]).attn
    assert kernel_options(attn.prefill, 256, 64, torch.float32) == {"BLOCK_N": 32, "BLOCK_M": 32, "num_stages": 2}
    assert kernel_options(attn.decode, 512, 64, torch.float32) == {
        "BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    assert kernel_options(attn.prefill, 128, 64, torch.float32) == {"BLOCK_N": 64}  # small heads: untouched


def test_each_compiled_function_keeps_its_own_dynamo_cache():
    """Engines in one process must not share one cache and one recompile limit (the sixth small
    engine of a GPU test process hit it)."""

    def scale(x):
        return x * 2

    a, b = compile_fn(scale, CompileCounter()), compile_fn(scale, CompileCounter())
    for dtype in (torch.float32, torch.float64):
        a(torch.ones(3, dtype=dtype))
    b(torch.ones(3))
    assert _debug_get_cache_entry_list(scale.__code__) == []
    assert len(_debug_get_cache_entry_list(a._torchdynamo_orig_callable.__code__)) == 2
    assert len(_debug_get_cache_entry_list(b._torchdynamo_orig_callable.__code__)) == 1


def test_compiled_kv_norm_write_writes_the_pools_in_place():
    """glue.kv_norm_write compiled (Inductor, dynamic shapes): the pools get what the norms and
    KVPools' index_copy write, at the given slots only, in their own storage (a copy of a pool
    would leave the engine's tensor unwritten), for two lengths through one compilation."""
    from flexgemma.model.glue import kv_norm_write, norm_rope, rms_norm

    torch.manual_seed(0)
    counter = CompileCounter()
    fused = compile_fn(kv_norm_write, counter)
    heads, d, slots_total = 2, 16, 40
    k_pool, v_pool = torch.zeros(1, heads, slots_total, d), torch.zeros(1, heads, slots_total, d)
    ptrs = (k_pool.data_ptr(), v_pool.data_ptr())
    want_k, want_v = k_pool.clone(), v_pool.clone()
    w = torch.randn(d)
    for t in (5, 9):
        k, v = torch.randn(t, heads, d), torch.randn(t, heads, d)
        cos, sin = torch.randn(t, d), torch.randn(t, d)
        slots = torch.randperm(slots_total)[:t]
        fused(k, v, w, cos, sin, 1e-6, k_pool, v_pool, slots)
        want_k.index_copy_(2, slots, norm_rope(k, w, cos, sin, 1e-6).transpose(0, 1)[None])
        want_v.index_copy_(2, slots, rms_norm(v, None, 1e-6).transpose(0, 1)[None])
        torch.testing.assert_close(k_pool, want_k, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(v_pool, want_v, atol=1e-6, rtol=1e-5)
    assert (k_pool.data_ptr(), v_pool.data_ptr()) == ptrs
    assert counter.count <= 2  # the second length reuses the dynamic graph (or one recompile)


def test_engine_with_the_fused_kv_write_generates_the_same():
    """kernels.fused_kv_write through a compiled engine on the CPU (prefill and decode steps): the same
    greedy tokens and logprobs as the norms followed by KVPools.write; the key reaches every layer."""
    from flexgemma import SamplingParams, build_engine

    def build(*extra):
        return build_engine(compose(["+model=tiny", "device=cpu", "engine.compile=true", "engine.max_batch_size=4",
                                     "kv.cpu_pages=64", *extra]))

    assert all(a.fused_kv_write for a in build("kernels.fused_kv_write=true").runner.forward.attn)
    prompts = [[2] + list(range(5, 5 + n)) for n in (9, 30, 17)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    runs = outputs_per_setting(build, "kernels.fused_kv_write", (False, True), prompts, params)
    for plain, fused in zip(*runs):
        assert plain.token_ids == fused.token_ids
        torch.testing.assert_close(torch.tensor(fused.logprobs), torch.tensor(plain.logprobs), atol=1e-5, rtol=0)
