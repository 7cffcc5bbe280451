"""Which GPU kernels give a row the same bits whatever else is in the batch (a probe, not a test).

Prints, per kernel and setting, whether one row's output is bitwise the same when it is computed alone,
at another position, or in a larger batch: the facts the batch-invariant mode (engine.batch_invariant)
is built on. Sections: a Triton matmul over tile shapes, torch.mm (cuBLAS), flex_attention decode-shaped vs
prefill-shaped, Inductor-compiled and eager row reductions.
"""
import itertools
import os
import sys
import traceback

import torch
import triton
import triton.language as tl
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


@triton.jit
def _mm(x_ptr, w_ptr, o_ptr, M, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    pm, pn = pid % num_m, pid // num_m
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=(rm[:, None] < M) & ((k0 + rk)[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :], mask=(rn[:, None] < N) & ((k0 + rk)[None, :] < K), other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    tl.store(o_ptr + rm[:, None] * N + rn[None, :], acc.to(o_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def mm(x, w, bm, bn=64, bk=64, warps=4, stages=3):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _mm[grid](x, w, out, m, n, k, BM=bm, BN=bn, BK=bk, IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return out


def same(a, b):
    return torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a, b.view(torch.uint8) if b.dtype != torch.bool else b)


def section(name, fn):
    print(f"\n## {name}", flush=True)
    try:
        fn()
    except Exception:
        traceback.print_exc(limit=3)


def triton_mm():
    for dt in (torch.bfloat16, torch.float32):
        for k, n in ((1536, 2048), (5376, 4096)):
            w = torch.randn(n, k, device="cuda").to(dt)
            x = torch.randn(512, k, device="cuda").to(dt)
            ref = mm(x[:1], w, 16)
            rows = {}
            for bm in (16, 32, 64, 128):
                for warps in (4, 8):
                    for m in (1, 7, 64, 512):
                        y = mm(x[:m], w, bm, warps=warps)
                        rows[(bm, warps, m)] = same(y[:1], ref)
            bad = [key for key, ok in rows.items() if not ok]
            print(f"triton mm {dt} K{k} N{n}: row 0 same across BM/warps/M: {not bad}; differing (BM, warps, M): {bad[:8]}")
            # BK changes the K order: expected to differ
            print(f"  BK 32 vs 64 same: {same(mm(x[:1], w, 16, bk=32), ref)}")
            y16 = mm(x, w, 16)
            print(f"  every row of M=512 at BM16 == alone: {all(same(y16[i:i+1], mm(x[i:i+1], w, 16)) for i in range(0, 512, 37))}")


def cublas():
    for dt in (torch.bfloat16, torch.float32):
        torch.backends.cuda.matmul.allow_tf32 = False
        for k, n in ((1536, 2048), (2816, 262144 // 8)):
            w = torch.randn(n, k, device="cuda").to(dt)
            x = torch.randn(1024, k, device="cuda").to(dt)
            full = x @ w.t()
            bad = [m for m in (1, 2, 3, 8, 16, 33, 64, 128, 256, 512) if not same((x[:m] @ w.t())[:1], full[:1])]
            print(f"torch.mm {dt} K{k} N{n}: M where row 0 differs from M=1024: {bad}")


def flex():
    torch.manual_seed(0)
    H, HKV, D, L = 8, 1, 256, 1024
    for dt in (torch.bfloat16, torch.float32):
        k = torch.randn(1, HKV, L, D, device="cuda", dtype=dt)
        v = torch.randn(1, HKV, L, D, device="cuda", dtype=dt)
        q_all = torch.randn(1, H, L, D, device="cuda", dtype=dt)
        causal = lambda b, h, qi, kv: kv <= qi  # noqa: E731
        bm_p = create_block_mask(causal, 1, 1, L, L, device="cuda", BLOCK_SIZE=(64, 64))
        for opts_name, opts in (("forced 64/64", {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 64, "BLOCK_N": 64}),
                                ("forced 32/32", {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 32, "BLOCK_N": 32}),
                                ("default decode", None)):
            if dt == torch.float32 and opts is not None:
                opts = {**opts, "BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1}
            fa = torch.compile(flex_attention, dynamic=False)
            pre = fa(q_all, k, v, block_mask=bm_p, scale=1.0, enable_gqa=True,
                     kernel_options=opts if opts else {"FORCE_USE_FLEX_ATTENTION": True})
            results = []
            for p in (5, 100, 700, 1023):
                for B in (1, 16):
                    qd = q_all[:, :, p:p + 1].expand(B, H, 1, D).contiguous()
                    pos = torch.full((B,), p, device="cuda")
                    mask_mod = lambda b, h, qi, kv, pos=pos: kv <= pos[b]  # noqa: E731
                    bm_d = create_block_mask(mask_mod, B, 1, 1, L, device="cuda", BLOCK_SIZE=(64, 64))
                    fd = torch.compile(flex_attention, dynamic=False)
                    dec = fd(qd, k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1), block_mask=bm_d, scale=1.0, enable_gqa=True,
                             kernel_options=opts)
                    results.append(same(dec[0, :, 0], pre[0, :, p]))
            print(f"flex {dt} {opts_name}: decode row == prefill row at p in (5,100,700,1023) x B in (1,16): {results}")


def reductions():
    torch.manual_seed(0)

    def rms(x, w):
        xf = x.float()
        return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5) * w.float()).type_as(x)

    for h in (1536, 5376):
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(4096, h, device="cuda", dtype=torch.bfloat16)
        comp = torch.compile(rms, dynamic=True)
        ref_c, ref_e = comp(x[:1], w), rms(x[:1], w)
        print(f"rms H{h}: compiled row0 same across T=1,2,7,64,1000,4096: "
              f"{[same(comp(x[:t], w)[:1], ref_c) for t in (2, 7, 64, 1000, 4096)]}; eager: "
              f"{[same(rms(x[:t], w)[:1], ref_e) for t in (2, 7, 64, 1000, 4096)]}; compiled==eager: {same(ref_c, ref_e)}")
    x = torch.randn(512, 262144, device="cuda")
    r = torch.logsumexp(x[:1], -1)
    print(f"logsumexp 262144 eager row0 same at B=2,8,64,512: {[same(torch.logsumexp(x[:b], -1)[:1], r) for b in (2, 8, 64, 512)]}")


def moe_tiles():
    """26B-A4B's routed experts (moe_kernel.decode_experts, entries sorted) at BLOCK_M 16-128: is a row
    the same bits at every tile row count and in every step size (then kernels.invariant_experts=triton
    may size its tiles by the step: moe_kernel.invariant_block_m), and what each costs at a decode step
    (128 rows) and a prefill chunk (8,192 tokens)."""
    from flexgemma.model.moe_kernel import decode_experts
    from flexgemma.model.quant import Bnb4Settings, PackedExpertWeight
    from flexgemma.tasks.common import cuda_time_ms

    torch.manual_seed(0)
    dev = torch.device("cuda")
    e, h, i, k = 128, 2816, 704, 8
    gate_up = (torch.randn(e, 2 * i, h, device=dev) * 0.02).bfloat16()
    down = (torch.randn(e, h, i, device=dev) * 0.02).bfloat16()
    s = Bnb4Settings(double_quant=True)
    kinds = {"bf16": (gate_up, down), "bnb4": (PackedExpertWeight.pack(gate_up, s, dev),
                                               PackedExpertWeight.pack(down, s, dev))}
    x = torch.randn(8192, h, device=dev, dtype=torch.bfloat16)
    w, idx = torch.softmax(torch.randn(8192, e, device=dev), -1).topk(k, dim=-1)

    def run(gu, dn, t, bm, warps=4, mode=None, subtiles=1):
        tiles = {"BLOCK_M": bm, "num_warps": warps, "SUBTILES": subtiles}
        return decode_experts(x[:t], idx[:t], w[:t], gu, dn, up_tiles=tiles, down_tiles=tiles, packed_mode=mode,
                              sort_entries=True, max_entries=None)

    def ms(fn, reps=10):
        return cuda_time_ms(fn, iters=reps, warmup=1)

    # PROBE_MOE=bnb4 (a kind) runs that kind alone
    only = os.environ.get("PROBE_MOE", "")
    for kind, mode in (("bf16", None), ("bnb4", "fused")):
        if only and only != kind:
            continue
        gu, dn = kinds[kind]
        ref = run(gu, dn, 8192, 16, mode=mode)
        if mode == "fused":  # kernels.invariant_4bit_subtiles=4: each decoded block shared by four 16-row tiles
            same_rows = [same(run(gu, dn, t, 16, mode=mode, subtiles=4), ref[:t]) for t in (7, 128, 8192)]
            print(f"moe {kind} {mode} BLOCK_M 16 SUBTILES 4: rows at T=7,128,8192 == one tile's: {same_rows}; "
                  f"8192 rows {ms(lambda: run(gu, dn, 8192, 16, mode=mode, subtiles=4), 3):.2f} ms", flush=True)
        for bm in (16, 32, 64, 128):
            for warps in ((4, 8) if bm >= 64 else (4,)):
                # every token of a step of T against the same token at BLOCK_M 16 in the step of 8,192
                same_rows = [same(run(gu, dn, t, bm, warps, mode), ref[:t]) for t in (1, 7, 128, 8192)]
                print(f"moe {kind} {mode} BLOCK_M {bm} warps {warps}: rows at T=1,7,128,8192 == BLOCK_M 16's: "
                      f"{same_rows}; 128 rows {ms(lambda: run(gu, dn, 128, bm, warps, mode)):.3f} ms, 8192 rows "
                      f"{ms(lambda: run(gu, dn, 8192, bm, warps, mode), 3):.2f} ms", flush=True)


def scaled_weights():
    """kernels.invariant_4bit_scale=weights on 26B-A4B's expert shapes: which slots tiles (BLOCK_M, BLOCK_K,
    warps) give each token of a 512-token step the bits the fused 16-row kernels give it (the mode's claim),
    and, per code lookup and prefetch, which tokens the fused kernels give other bits alone than in the step
    (every token) and through which of their routed experts (each choice alone against the step of every
    token's same choice)."""
    from flexgemma.config.kernels import Kernels
    from flexgemma.model.moe_kernel import decode_experts
    from flexgemma.model.quant import Bnb4Settings, PackedExpertWeight

    torch.manual_seed(0)
    dev = torch.device("cuda")
    e, h, i, k, t = 128, 2816, 704, 8, 512
    s = Bnb4Settings(double_quant=True)
    gate_up = PackedExpertWeight.pack((torch.randn(e, 2 * i, h) * 0.05).bfloat16(), s, dev)
    down = PackedExpertWeight.pack((torch.randn(e, h, i) * 0.05).bfloat16(), s, dev)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    w, idx = torch.softmax(torch.randn(t, e, device=dev), -1).topk(k, dim=-1)

    def run(rows, mode, choices=slice(None), kernels=Kernels(), **tiles):
        return decode_experts(x[rows], idx[rows, choices], w[rows, choices], gate_up, down, up_tiles=dict(tiles),
                              down_tiles=dict(tiles), packed_mode=mode, sort_entries=True, max_entries=None,
                              scale_weights=True, kernels=kernels)

    # the experts whose bf16 block scales differ between ncode * nested + offset rounded twice (the slot
    # dequantise, compiled without contraction) and rounded once (a fused multiply-add)
    suspects = torch.zeros(e, dtype=torch.bool, device=dev)
    for wt in (gate_up, down):
        code8, nested = wt.absmax.long(), wt.nested_absmax.float()
        a = wt.nested_code.float()[code8]
        b = nested[:, torch.arange(code8.shape[1], device=dev) // wt.NESTED_BLOCK]
        c = wt.nested_offset.float().reshape(e, 1)
        once = (a.double() * b.double() + c.double()).float()
        suspects |= ((a * b + c).bfloat16() != once.bfloat16()).any(1)
    touched = suspects[idx].any(-1)
    print(f"experts whose scales a multiply-add moves: {suspects.nonzero().flatten().tolist()}; tokens routed to "
          f"one: {int(touched.sum())}/{t}", flush=True)
    fused = run(slice(0, t), "fused", BLOCK_M=16)
    for bm, bk, warps in ((16, 32, 4), (16, 128, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 8)):
        got = run(slice(0, t), "slots", BLOCK_M=bm, BLOCK_K=bk, num_warps=warps)
        rows_equal = (got.view(torch.int16) == fused.view(torch.int16)).all(-1)
        print(f"slots BLOCK_M {bm} BLOCK_K {bk} warps {warps}: {int(rows_equal.sum())}/{t} tokens == fused; "
              f"others routed to a suspect: {int((~rows_equal & touched).sum())}/{int((~rows_equal).sum())}",
              flush=True)
    for lookup, prefetch in itertools.product(("table", "prmt"), (False, True)):
        kern = Kernels(moe_code_lookup=lookup, moe_4bit_prefetch=prefetch)
        step = run(slice(0, t), "fused", kernels=kern, BLOCK_M=16, PREFETCH=prefetch)
        alone = torch.cat([run(slice(j, j + 1), "fused", kernels=kern, BLOCK_M=16, PREFETCH=prefetch) for j in range(t)])
        other = (~(alone.view(torch.int16) == step.view(torch.int16)).all(-1)).nonzero().flatten().tolist()
        line = f"fused {lookup} prefetch {prefetch}: {t - len(other)}/{t} tokens alone == in the step"
        if other:
            j = other[0]
            moved = [int(idx[j, c]) for c in range(k)
                     if not same(run(slice(j, j + 1), "fused", slice(c, c + 1), kern, BLOCK_M=16, PREFETCH=prefetch),
                                 run(slice(0, t), "fused", slice(c, c + 1), kern, BLOCK_M=16, PREFETCH=prefetch)[j:j + 1])]
            line += (f"; others {other[:8]}, routed to a suspect {int(touched[other].sum())}/{len(other)}; token {j}'s "
                     f"choices alone != in the step: experts {moved} (max |diff| "
                     f"{(alone[j].float() - step[j].float()).abs().max().item():.3g})")
        print(line, flush=True)


if __name__ == "__main__":
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    for name in sys.argv[1:] or ["triton_mm", "cublas", "flex", "reductions"]:
        section(name, globals()[name])
