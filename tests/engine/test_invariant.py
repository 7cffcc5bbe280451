"""engine.batch_invariant: a request's tokens and logprobs are bitwise the same whatever else runs.

The same request alone, at slot 7 of 32 others, in a batch of 256, under prefill chunks of 16 and 64
tokens, after preemption, on a prefix-cache hit; and engine.score() of the finished sequence returns
the logprobs generate() returned. tiny and tiny_moe in float32 and bfloat16 on the CPU (GPU tests at
the end, on each model's real shapes). Each check can fail: `test_the_check_sees_a_batch_dependent_product`
runs it with a product whose rows depend on the batch (torch's own float32 GEMM) and expects it to fail.
"""

import textwrap

import pytest
import torch
import torch.nn.functional as F

from conftest import GPU_SHAPES, make_engine, run_interpreted
from flexgemma import SamplingParams
from flexgemma.model.invariant import matmul as inv_matmul
from flexgemma.model.invariant.attention import InvariantAttentionOptions, RowTable, paged_attention
from flexgemma.model.invariant.logprobs import token_logprobs

INV = "engine.batch_invariant=true"
NEW = 12


def prompts(n: int, seed: int = 1, lo: int = 5, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def params(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=1000 + i, ignore_eos=True)


def same(a, b) -> bool:
    """Bitwise: tokens and logprobs (floats compared as they are; no tolerance)."""
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs


# -- the kernels ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_does_not_depend_on_the_other_rows(dtype):
    torch.manual_seed(0)
    w = torch.randn(96, 200).to(dtype)
    x = torch.randn(70, 200).to(dtype)
    full = inv_matmul.linear(x, w)
    for i in (0, 7, 15, 16, 69):
        assert torch.equal(inv_matmul.linear(x[i:i + 1], w)[0], full[i])
        shuffled = torch.cat([x[i + 1:], x[:i + 1]])  # row i last, after every other
        assert torch.equal(inv_matmul.linear(shuffled, w)[-1], full[i])
    assert torch.allclose(full.float(), x.float() @ w.float().t(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                          atol=1e-1 if dtype == torch.bfloat16 else 1e-4)


def test_triton_matmul_folds_and_splits_to_the_same_bits_interpreted():
    """The GPU kernels through Triton's interpreter (float32): a program adding its K chunks in order and
    the chunks computed apart then summed in order give the same bits, at any row count, with the chunk loop
    flattened or not (kernels.invariant_flatten: the GPU test checks that compiled)."""
    out = run_interpreted(INTERPRETER_LOOPS + textwrap.dedent("""
        import torch
        from flexgemma.model.invariant import triton_matmul as tm
        torch.manual_seed(0)
        w = torch.randn(70, 1100)
        x = torch.randn(40, 1100)
        cfg = dict(BM=16, BN=32, BK=32, num_warps=4, num_stages=2)
        a, b, c = torch.empty(40, 70), torch.empty(40, 70), torch.empty(1, 70)
        tm.fold(x, w, a, 512, cfg)
        tm.split_then_sum(x, w, b, 3, 512, cfg)
        tm.fold(x[5:6], w, c, 512, cfg)
        counts = torch.tensor([3, 0, 30, 7])
        we = torch.randn(4, 70, 1100)
        g = tm.grouped(x, we, counts, 512, cfg)
        print(torch.equal(a, b), torch.equal(a[5], c[0]), (a - x @ w.t()).abs().max().item() < 1e-3, g.shape[0] == 40)
        # the split's chunks added by each tile's last program, twice (the counters back at 0 after a launch)
        for _ in range(2):
            s = torch.full((40, 70), float("nan"))
            tm.split_last_sums(x, w, s, 3, 512, cfg)
            print(torch.equal(a, s))
        d = torch.empty(40, 70)
        tm.fold(x, w, d, 512, cfg, flatten=True)
        print(torch.equal(a, d), torch.equal(g, tm.grouped(x, we, counts, 512, cfg, flatten=True)))
        # chunks shorter than the tiles' K step (kernels.invariant_k_chunk=16): each chunk's K alone
        e, f, j = torch.empty(40, 70), torch.empty(40, 70), torch.empty(40, 70)
        tm.fold(x, w, e, 16, cfg)
        tm.split_then_sum(x, w, f, 69, 16, cfg)
        tm.fold(x, w, j, 16, cfg, flatten=True)
        print(torch.equal(e, f), torch.equal(e, j), (e - x @ w.t()).abs().max().item() < 1e-3,
              (tm.grouped(x, we, counts, 16, cfg)[:3] - x[:3] @ we[0].t()).abs().max().item() < 1e-3)
        # the fold with its blocks moved by tensor descriptors (kernels.invariant_loads=tma; 68 columns: a
        # descriptor's row stride is a multiple of 16 bytes): past the 40 rows, 68 columns and 1,100 K of the
        # tiles the blocks read zeros, as the masks give
        for kc, ref in ((512, a), (16, e)):
            chunks = -(-1100 // kc)
            for run in (lambda o: tm.fold(x, w[:68], o, kc, cfg, tma=True),
                        lambda o: tm.split_then_sum(x, w[:68], o, chunks, kc, cfg, tma=True),
                        lambda o: tm.split_last_sums(x, w[:68], o, chunks, kc, cfg, tma=True)):
                t = torch.full((40, 68), float("nan"))
                run(t)
                print(torch.equal(ref[:, :68], t))
        # the tile order (bands of GM row tiles; 3 row tiles here: a full band of 2 and one of 1) reaches
        # every tile once and moves no bit; the outputs start as NaN, so a tile missed shows
        for gm in (1, 2):
            h, i = torch.full((40, 70), float("nan")), torch.full((40, 70), float("nan"))
            tm.fold(x, w, h, 512, dict(cfg, GM=gm))
            tm.split_then_sum(x, w, i, 3, 512, dict(cfg, GM=gm))
            print(torch.equal(a, h), torch.equal(a, i))
    """))
    assert out.split() == ["True"] * 22


# Triton's interpreter converts a loop bound held in a tensor with int(), which numpy 2 refuses for the
# one-element arrays the interpreter keeps scalars in; the kernels loop over runtime bounds
INTERPRETER_LOOPS = """
import triton.runtime.interpreter as _interp
_patch = _interp._patch_lang_tensor
def _patch_index(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
_interp._patch_lang_tensor = _patch_index
"""


def test_triton_attention_decode_equals_prefill_interpreted():
    """The GPU attention kernel through Triton's interpreter (float32): prefill tiles of several queries
    (GQA, two KV heads, sliding or causal, a padding run) and decode (chunks in parallel programs, then
    folded) give each query the same bits, close to the CPU path's softmax."""
    out = run_interpreted(INTERPRETER_LOOPS + """
import torch
from flexgemma.model.invariant.attention import RowTable, _paged_attention_cpu
from flexgemma.model.invariant import triton_attention as ta
torch.manual_seed(0)
k, v = torch.randn(1, 2, 320, 64), torch.randn(1, 2, 320, 64)
table = torch.tensor([[3, 9, 1, 4, 12, 7, -1, -1], [5, 6, 2, 8, 10, -1, -1, -1], [-1] * 8], dtype=torch.int32)
q = torch.randn(76, 8, 64)
q_row = torch.tensor([1] * 20 + [0] * 50 + [2] * 6, dtype=torch.int32)
q_pos = torch.cat([torch.arange(10, 30), torch.arange(5, 55), torch.zeros(6, dtype=torch.long)]).int()
for win in (None, 24):
    rows = RowTable(table, q_row, q_pos, win, False, 96, [(0, 20), (20, 50), (70, 6)])
    pre = ta.paged_attention(q, k, v, rows, 16, 32, 16)
    dec = ta.paged_attention(q, k, v, RowTable(table, q_row, q_pos, win, True, 96), 16, 32, 16)
    ref = _paged_attention_cpu(q, k, v, RowTable(table, q_row, q_pos, win, False, 96), 16, 32, 16)
    print(torch.equal(dec, pre), (pre - ref).abs().max().item() < 1e-4, pre[70:].abs().max().item() == 0.0)
    # the row tiles are built once per table (every layer of a step reads it), then reused
    tiles = dict(rows.tiles)
    again = ta.paged_attention(q, k, v, rows, 16, 32, 16)
    print(torch.equal(again, pre), len(tiles) == 1 and all(a is b for a, b in zip(tiles.values(), rows.tiles.values())))
    print(torch.equal(ta.paged_attention(q, k, v, rows, 16, 32, 16, flatten=True), pre))
""")
    assert out.split() == ["True"] * 12


def test_triton_logprobs_whole_and_streamed_agree_interpreted():
    """The sampler's stream (the whole vocabulary in one update) and the trainer's (a slice at a time):
    the same bits, close to torch's log_softmax of the capped logits."""
    out = run_interpreted(INTERPRETER_LOOPS + """
import torch
from flexgemma.model.invariant import triton_logprobs as tl_
torch.manual_seed(0)
head = torch.randn(6, 8192 + 300) * 20
tokens = torch.randint(0, head.shape[1], (6,))
def stream(width):
    lane_max, lane_sum = torch.full((6, 4096), float("-inf")), torch.zeros(6, 4096)
    for v0 in range(0, head.shape[1], width):
        tl_.update(head[:, v0: v0 + width], lane_max, lane_sum, 30.0)
    return tl_.finish(lane_max, lane_sum, head.gather(1, tokens[:, None])[:, 0], 30.0)
whole, streamed = stream(head.shape[1]), stream(4096)
ref = torch.log_softmax(torch.tanh(head / 30) * 30, -1).gather(1, tokens[:, None])[:, 0]
print(torch.equal(whole, streamed), (whole - ref).abs().max().item() < 1e-4)
""")
    assert out.split() == ["True", "True"]


def _pools(pages=40, page=8, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, hkv, pages * page, d, generator=g), torch.randn(1, hkv, pages * page, d, generator=g))


@pytest.mark.parametrize("window", [None, 16])
def test_attention_of_a_query_is_the_same_in_decode_and_in_a_prefill_chunk(window):
    """A sequence's 50 queries as one prefill chunk (with another sequence's chunk packed before it) and
    each query as a decode row beside others: the same bits."""
    torch.manual_seed(0)
    k, v = _pools()
    table = torch.tensor([[3, 9, 1, 4, 12, 7, 30, -1], [5, 6, 2, 8, 10, -1, -1, -1]], dtype=torch.int32)
    q = torch.randn(50 + 20, 4, 32)
    q_row = torch.tensor([1] * 20 + [0] * 50, dtype=torch.int32)
    q_pos = torch.cat([torch.arange(10, 30), torch.arange(5, 55)]).int()
    opts = InvariantAttentionOptions(split_tokens=16, block_n=8)
    pre = paged_attention(q, k, v, RowTable(table, q_row, q_pos, window, False, 64, [(0, 20), (20, 50)]), 8, opts)
    for i in (20, 21, 40, 69):
        rows = torch.tensor([0, i, 3])  # the query between two others
        dec = paged_attention(q[rows], k, v, RowTable(table, q_row[rows], q_pos[rows], window, True, 64), 8, opts)
        assert torch.equal(dec[1], pre[i])


def test_attention_equals_softmax_attention():
    k, v = _pools(hkv=1)
    table = torch.tensor([[3, 9, 1, 4]], dtype=torch.int32)
    q = torch.randn(1, 2, 32)
    out = paged_attention(q, k, v, RowTable(table, torch.tensor([0], dtype=torch.int32),
                                            torch.tensor([20], dtype=torch.int32), None, True, 32), 8)
    slots = torch.cat([torch.arange(p * 8, p * 8 + 8) for p in (3, 9, 1)])[:21]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[:, :, slots], v[:, :, slots], scale=1.0)
    assert torch.allclose(out, ref[0].transpose(0, 1), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_of_a_row_do_not_depend_on_the_batch(dtype):
    torch.manual_seed(0)
    head = (torch.randn(45, 512) * 20).to(dtype)
    tokens = torch.randint(0, 512, (45,))
    full = token_logprobs(head, tokens, 30.0)
    assert all(torch.equal(token_logprobs(head[i:i + 1], tokens[i:i + 1], 30.0)[0], full[i]) for i in (0, 13, 44))
    capped = torch.tanh(head.float() / 30) * 30
    ref = torch.log_softmax(capped, -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(full, ref, atol=1e-5)


# -- the engine ----------------------------------------------------------------------------------
ENGINES = {}


def engine(model: str, dtype: str, *extra: str):
    key = (model, dtype, extra)
    if key not in ENGINES:
        ENGINES[key] = make_engine(INV, f"model.dtype={dtype}", "engine.max_batch_size=64", "kv.cpu_pages=400",
                                   *extra, model=model)
    return ENGINES[key]


def check_alone_slot_and_score(eng, ps, target: int = 7):
    alone = eng.generate([ps[target]], [params(target)])[0]
    batch = eng.generate(ps, [params(i) for i in range(len(ps))])
    assert same(alone, batch[target]), "alone vs in a batch"
    seq = ps[target] + alone.token_ids
    scored = eng.score([seq], [len(ps[target])])[0]
    assert scored.logprobs == alone.logprobs, "score() vs generate()"
    return alone


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_alone_at_slot_7_of_33_and_scored_give_the_same_bits(model, dtype):
    check_alone_slot_and_score(engine(model, dtype), prompts(33))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_in_a_batch_of_256(model):
    eng = make_engine(INV, "engine.max_batch_size=256", "kv.cpu_pages=1200", "engine.max_model_len=128", model=model)
    ps = prompts(256, seed=3, hi=40)
    alone = eng.generate([ps[200]], [params(200)])[0]
    assert same(alone, eng.generate(ps, [params(i) for i in range(256)])[200])


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_prefill_chunks_of_16_64_and_default_give_the_same_bits(model):
    ps = prompts(6, seed=5, lo=40, hi=120)
    runs = [make_engine(INV, f"engine.max_prefill_tokens={n}", model=model).generate(ps, [params(i) for i in range(6)])
            for n in (16, 64, 8192)]
    for other in runs[1:]:
        assert all(same(a, b) for a, b in zip(runs[0], other))


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_after_preemption_the_same_bits(model):
    """A pool too small for the batch: sequences are preempted and recomputed."""
    ps = prompts(12, seed=7, lo=30, hi=50)
    roomy = make_engine(INV, "kv.cpu_pages=400", model=model).generate(ps, [params(i) for i in range(12)])
    tight = make_engine(INV, "kv.cpu_pages=40", "engine.max_model_len=128", model=model)
    squeezed = tight.generate(ps, [params(i) for i in range(12)])
    assert tight.stats.preemptions > 0
    assert all(same(a, b) for a, b in zip(roomy, squeezed))


def filtered(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=0.8, top_k=(0, 20, 5)[i % 3], top_p=(0.9, 1.0, 0.7)[i % 3],
                          seed=2000 + i, ignore_eos=True)


def check_filtered_rows(eng, ps):
    sps = [params(i) if i == 8 else filtered(i) for i in range(len(ps))]
    batch = eng.generate(ps, sps)
    for i in (3, 4, 5, 8):
        assert same(eng.generate([ps[i]], [sps[i]])[0], batch[i]), f"row {i} alone vs in the filtered batch"


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_top_k_and_top_p_rows_draw_alone_as_among_other_filters(model):
    """Filtered sampling: a top-k / top-p row draws the same tokens (and logprobs) alone as in a batch
    whose rows filter otherwise, and a plain row in that batch as it does alone (the batch runs the
    filter for every row then)."""
    check_filtered_rows(engine(model, "bfloat16"), prompts(17, seed=31))


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_a_prefix_cache_hit_gives_the_same_bits(model):
    eng = engine(model, "float32")
    p = prompts(1, seed=11, lo=40, hi=41)[0]  # five full pages of 8
    eng.reset_prefix_cache()
    first = eng.generate([p], [params(0)])[0]
    again = eng.generate([p], [params(0)])[0]
    assert eng.stats.prefix_hit_tokens >= 32
    assert same(first, again)


@pytest.mark.parametrize("lora", [["lora=r16"], ["lora=r16", "lora.merge=false"]], ids=["merged", "unmerged"])
def test_lora_merged_and_unmerged(lora):
    check_alone_slot_and_score(engine("tiny_moe", "float32", *lora), prompts(33, seed=13))


def test_bnb4_weights():
    pytest.importorskip("bitsandbytes")
    check_alone_slot_and_score(engine("tiny", "bfloat16", "quant=bnb4", "lora=r16"), prompts(20, seed=17), target=5)


def test_the_check_sees_a_batch_dependent_product(monkeypatch):
    """The mutation the tests above must catch: torch's float32 GEMM (MKL picks its kernel by the row
    count) in place of the invariant product, and the CPU's row padding off."""
    from flexgemma.model.invariant import rows

    eng = make_engine(INV, "model.dtype=float32", "engine.max_batch_size=64", "kv.cpu_pages=400")
    monkeypatch.setattr(inv_matmul, "_linear_cpu", lambda x, w: F.linear(x, w))
    monkeypatch.setattr(rows, "ROW_MULTIPLE", 1)
    ps = prompts(33)
    with pytest.raises(AssertionError):
        check_alone_slot_and_score(eng, ps)


def test_the_default_mode_is_untouched():
    """Without engine.batch_invariant the engine runs its usual kernels (no RowTables, no invariant product)."""
    eng = make_engine()
    assert eng.runner.forward.invariant is None and not eng.runner.invariant
    assert eng.info["batch_invariant"] is False
    assert engine("tiny", "float32").info["batch_invariant"] is True


# -- the GPU: every model's real shapes, fewer layers -------------------------------------------
def invariant_gpu_engine(model: str, *extra: str):
    from flexgemma import build_engine, compose

    # two graph buckets: a lone row runs at 2 rows, the batch at 64 (different products, fewer captures)
    return build_engine(compose([f"+model={model}", INV, "device=cuda", "engine.max_batch_size=64",
                                 "engine.max_model_len=2048", "cudagraph.buckets=[2,64]", *GPU_SHAPES[model], *extra]))


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(GPU_SHAPES))
def test_gpu_alone_slot_chunked_and_scored(model):
    eng = invariant_gpu_engine(model)
    ps = prompts(33, seed=19, lo=20, hi=700)
    alone = check_alone_slot_and_score(eng, ps)
    chunked = invariant_gpu_engine(model, "engine.max_prefill_tokens=64", "cudagraph.enabled=false")
    assert same(alone, chunked.generate([ps[7]], [params(7)])[0]), "prefill chunks of 64, eager decode"


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["e2b", "26b_a4b"])
@pytest.mark.parametrize("other", ["kernels.invariant_flatten=false", "kernels.invariant_split_sum=last_program",
                                   "kernels.invariant_loads=pointers", "kernels.invariant_split_below_tiles=264"])
def test_gpu_speed_only_keys_give_the_same_bits(model, other):
    """A speed-only key's other side (the nested chunk loops; a split's chunks added by each tile's last
    program; the blocks through per-element pointers, where the default on sm_90 and newer is tensor
    descriptors; more products split) changes no bit: alone, at a slot, scored, and equal to the defaults'
    tokens and logprobs."""
    ps = prompts(33, seed=19, lo=20, hi=700)
    got = check_alone_slot_and_score(invariant_gpu_engine(model, other), ps)
    assert same(got, invariant_gpu_engine(model).generate([ps[7]], [params(7)])[0]), f"{other} vs the defaults"


@pytest.mark.gpu
def test_gpu_split_sums_by_the_last_program_launch_after_launch_and_in_a_graph():
    """kernels.invariant_split_sum=last_program on E2B's shapes, every product split (whatever its tiles):
    the second kernel's bits at 1-256 rows, launch after launch (each launch sets its counters back to 0) and
    replayed from a CUDA graph."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    split = dict(split_below_tiles=1 << 20)
    for n, k in ((1536, 12288), (2048, 1536), (256, 1536)):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5
        for m in (1, 7, 64, 256):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = inv_matmul.linear(x, w, split_sum="kernel", **split)
            for _ in range(3):
                assert torch.equal(inv_matmul.linear(x, w, split_sum="last_program", **split), ref), (n, k, m)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = inv_matmul.linear(x, w, split_sum="last_program", **split)
            for _ in range(3):
                out.zero_()
                graph.replay()
                assert torch.equal(out, ref), (n, k, m, "graph")


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["e2b", "26b_a4b"])
def test_gpu_top_k_and_top_p_rows(model):
    check_filtered_rows(invariant_gpu_engine(model), prompts(17, seed=31, lo=20, hi=400))


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [["quant=bnb4", "lora=r16"], ["quant=bnb4", "kernels.invariant_4bit_subtiles=1"],
                                   ["lora=r16"], ["kernels.invariant_experts=grouped"],
                                   ["quant=bnb4", "kernels.invariant_experts=grouped", "kernels.moe_dequant=triton"],
                                   ["quant=bnb4", "lora=r16", "kernels.invariant_4bit_scale=weights"]],
                         ids=["bnb4_lora", "bnb4_one_tile", "lora", "grouped", "bnb4_grouped_slot_dequant",
                              "bnb4_lora_scaled_weights"])
def test_gpu_26b_a4b_4bit_and_lora(extra):
    """26B-A4B's invariant experts in both kernels.invariant_experts forms: the routed kernels (the default;
    4-bit experts decoded inside them, each decoded block for four 16-row tiles at prefill-sized steps
    or, with kernels.invariant_4bit_subtiles=1, for one; with kernels.invariant_4bit_scale=weights, prefill
    through bf16 slots in step-sized tiles) and the grouped product (4-bit experts dequantised into slots by
    either kernel)."""
    pytest.importorskip("bitsandbytes") if "quant=bnb4" in extra else None
    check_alone_slot_and_score(invariant_gpu_engine("26b_a4b", *extra), prompts(33, seed=23, lo=20, hi=400))


# -- routed experts (SamplingParams.return_routed_experts) ---------------------------------------
@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "default"])
def test_routed_experts_per_token_in_generate_and_score(invariant):
    import numpy as np

    eng = make_engine(*([INV] if invariant else []), "engine.max_batch_size=64", "kv.cpu_pages=400", model="tiny_moe")
    ps = prompts(9, seed=29)
    sp = [SamplingParams(max_new_tokens=7, seed=i, ignore_eos=True, return_routed_experts=True) for i in range(9)]
    batch = eng.generate(ps, sp)
    alone = eng.generate([ps[4]], [sp[4]])[0]
    r = alone.routed_experts
    assert r.shape == (7, 6, 2) and r.dtype == np.uint8 and int(r.max()) < 8  # 6 MoE layers, top-2 of 8
    assert all((len(set(row)) == 2) for layer in r for row in [layer.tolist()[0]])  # two distinct experts
    assert np.array_equal(batch[4].routed_experts, r) and np.array_equal(batch[4].outputs[0].routed_experts, r)
    scored = eng.score([ps[4] + alone.token_ids], [len(ps[4])], return_routed_experts=True)[0]
    assert np.array_equal(scored.routed_experts, r)
    assert eng.generate([ps[0]], SamplingParams(max_new_tokens=3))[0].routed_experts is None  # not asked
    assert make_engine().generate([ps[0]], SamplingParams(max_new_tokens=3, return_routed_experts=True))[0] \
        .routed_experts is None  # a dense model routes nothing
