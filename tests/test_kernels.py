"""flex kernel options from the attn config, and compiled functions that belong to one engine."""

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from flexgemma import compose
from flexgemma.compiled import CompileCounter, compile_fn
from flexgemma.model.attention import kernel_options


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
