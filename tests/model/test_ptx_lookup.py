"""kernels.moe_code_lookup=prmt: the 4-bit code table held in registers and looked up by PTX prmt
(flexgemma/model/ptx_lookup.py), checked where Triton's interpreter cannot run inline assembly: the PTX itself
executed by tests/model/ptx_emulator.py for every byte value; on a GPU, the kernels' output bitwise that of
the table path."""

import pytest
import torch

from ptx_emulator import check, run

bf = pytest.importorskip("bitsandbytes.functional")


def test_prmt_lookup_gives_the_table_for_every_byte():
    """Every byte value gives its high and low nibbles' entries, for nf4 and fp4 tables in bf16 and fp16; a
    swapped byte selector in the assembly is caught (the check can fail); the emulator refuses what it does
    not know rather than skipping it."""
    from flexgemma.model.ptx_lookup import code_lookup_asm, lookup_asm

    for quant_type in ("nf4", "fp4"):
        for dtype in (torch.bfloat16, torch.float16):
            check(bf.get_4bit_type(quant_type, device="cpu").to(dtype))
            assert code_lookup_asm(quant_type, dtype) == lookup_asm(bf.get_4bit_type(quant_type, device="cpu").to(dtype))
    code = bf.get_4bit_type("nf4", device="cpu").bfloat16()
    asm = lookup_asm(code)
    assert sum(1 for ln in asm.splitlines() if ln[:1].isalpha() and not ln.startswith("mov")) == 26
    with pytest.raises(AssertionError, match="byte 0x00"):
        check(code, asm.replace("0x7351", "0x7315", 1))
    with pytest.raises(ValueError, match="not in the emulated subset"):
        run(asm.replace("lop3.b32", "lop4.b32", 1), 0)


def test_prmt_lookup_is_refused_off_an_nvidia_gpu():
    from flexgemma.config.kernels import Kernels
    from flexgemma.model.moe_kernel import decode_experts
    from flexgemma.model.quant import Bnb4Settings, PackedExpertWeight

    s = Bnb4Settings(compute_dtype=torch.float16)
    cpu = torch.device("cpu")
    gu = PackedExpertWeight.pack(torch.randn(2, 128, 64).half(), s, cpu)
    dn = PackedExpertWeight.pack(torch.randn(2, 64, 64).half(), s, cpu)
    x, idx, w = torch.randn(3, 64).half(), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(ValueError, match="moe_code_lookup=prmt runs inline PTX"):
        decode_experts(x, idx, w, gu, dn, kernels=Kernels(moe_code_lookup="prmt"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prmt_lookup_gives_the_table_paths_bits_on_a_gpu():
    """The fused 4-bit expert kernels with prmt give the table path's output bit for bit: decode steps with
    and without prefetch, nf4 and fp4, bf16 rows, with double quantisation; and the invariant experts."""
    from flexgemma.config.kernels import Kernels
    from flexgemma.model.moe_kernel import decode_experts, invariant_experts
    from flexgemma.model.quant import Bnb4Settings, PackedExpertWeight

    torch.manual_seed(0)
    dev = torch.device("cuda")
    e, h, i = 16, 512, 256
    for quant_type in ("nf4", "fp4"):
        s = Bnb4Settings(quant_type=quant_type, double_quant=True)
        gu = PackedExpertWeight.pack((torch.randn(e, 2 * i, h, device=dev) * 0.05).bfloat16(), s, dev)
        dn = PackedExpertWeight.pack((torch.randn(e, h, i, device=dev) * 0.05).bfloat16(), s, dev)
        for t in (1, 37, 256):
            x = torch.randn(t, h, device=dev).bfloat16()
            w, idx = torch.softmax(torch.randn(t, e, device=dev), -1).topk(4, dim=-1)
            for prefetch in (False, True):
                a = decode_experts(x, idx, w, gu, dn, kernels=Kernels(moe_4bit_prefetch=prefetch))
                b = decode_experts(x, idx, w, gu, dn, kernels=Kernels(moe_4bit_prefetch=prefetch,
                                                                      moe_code_lookup="prmt"))
                assert torch.equal(a, b), (quant_type, t, prefetch)
            assert a.abs().max() > 0
            for sub in (1, 4):
                a = invariant_experts(x, idx, w, gu, dn, Kernels(invariant_4bit_subtiles=sub))
                b = invariant_experts(x, idx, w, gu, dn, Kernels(invariant_4bit_subtiles=sub, moe_code_lookup="prmt"))
                assert torch.equal(a, b), (quant_type, t, sub)
