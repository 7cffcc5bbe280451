"""The trainer's forward through the engine's kernels (model/trainable.py, task.trainer_forward=engine):
its log-probabilities are bitwise the engine's (generate and score), its LoRA gradients match
transformers' within float32 tolerance, and it never holds the [tokens x vocab] logits."""

import pytest
import torch

from conftest import make_engine
from flexgemma import SamplingParams
from flexgemma.model.trainable import TrainableForward

INV = "engine.batch_invariant=true"


def rollout(eng, n=5, seed=1, new=10, lo=5, hi=40):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(3, 500, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]
    outs = eng.generate(ps, [SamplingParams(max_new_tokens=new, temperature=1.0, seed=i, ignore_eos=True)
                             for i in range(n)])
    return ps, outs


def check_bitwise(eng, **shape):
    from torch._dynamo.utils import counters

    ps, outs = rollout(eng, **shape)
    graphs = counters["stats"]["unique_graphs"]
    tf = TrainableForward(eng.runner.forward, eng.lora)
    lps, _ = tf.token_logprobs([p + o.token_ids for p, o in zip(ps, outs)], [len(p) for p in ps])
    assert counters["stats"]["unique_graphs"] == graphs, "the trainer compiled glue of its own"
    for lp, o in zip(lps, outs):
        assert lp.tolist() == o.logprobs


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_logprobs_are_the_engines_bit_for_bit(model, dtype):
    check_bitwise(make_engine(INV, f"model.dtype={dtype}", "lora=r16", model=model))


@pytest.mark.parametrize("model, extra", [("tiny", ["lora.merge=false"]), ("tiny", ["quant=bnb4", "model.dtype=bfloat16"]),
                                          ("tiny_moe", ["quant=bnb4", "model.dtype=bfloat16"]),
                                          ("tiny", ["kernels.trainer_vocab_slice=64", "model.dtype=bfloat16"])],
                         ids=["unmerged", "bnb4", "moe_bnb4", "head_in_8_slices"])
def test_trainer_logprobs_bitwise_unmerged_and_4bit(model, extra):
    if "quant=bnb4" in extra:
        pytest.importorskip("bitsandbytes")
    check_bitwise(make_engine(INV, "lora=r16", *extra, model=model))


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_the_trainer_runs_the_glue_the_engine_compiled(model):
    """With the glue compiled (engine.compile=true, a GPU's default), the trainer's forward and backward
    compile none of the engine's functions again: torch.compile guards on grad and inference mode, and a
    glue function compiled again for the trainer may reduce a row with other tiles (on the H200: the exact
    GRPO jobs 0.34 nats apart). The backward's compiled references (kernels.trainer_glue_backward=compiled,
    the default) count on a counter of their own."""
    eng = make_engine(INV, "lora=r16", "engine.compile=true", model=model)
    ps, outs = rollout(eng)
    for p in eng.lora.slots.values():
        p.requires_grad_(True)
    graphs = eng.compile_counter.count
    tf = TrainableForward(eng.runner.forward, eng.lora)
    lps, _ = tf.token_logprobs([p + o.token_ids for p, o in zip(ps, outs)], [len(p) for p in ps])
    torch.stack([lp.sum() for lp in lps]).sum().backward()  # the checkpointed layers run again
    assert graphs > 0 and eng.compile_counter.count == graphs, "the trainer compiled the engine's glue again"
    assert [lp.tolist() for lp in lps] == [o.logprobs for o in outs]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in eng.lora.slots.values())


def test_the_trainer_calls_the_glue_with_the_engines_layouts():
    """The engine hands its glue views of fused projections' outputs (a row stride wider than the row,
    an offset); torch.compile guards on sizes, strides and offsets and on inference tensors, so the trainer's
    aliases keep all of them and hit the engine's graph (contiguous copies compiled a second graph on the
    H200, whose norm+RoPE put 2 rows in 349 a bit apart)."""
    from flexgemma.model.compiled import CompileCounter, compile_fn
    from flexgemma.model import glue
    from flexgemma.model.invariant.rows import serial
    from flexgemma.model.trainable import as_the_engine_calls, storage_alias

    counter = CompileCounter()
    fn = compile_fn(glue.gelu_mul, counter)
    with torch.inference_mode(), serial():  # the CPU engine: gate and up split from one [T, 2 x 24] output
        gate, up = torch.randn(7, 48).split(24, dim=-1)
        want = fn(gate, up)
        gate9, up9 = torch.randn(9, 48).split(24, dim=-1)
        fn(gate9, up9)  # a second row count: the graph's rows are dynamic
    graphs = counter.count
    fused = torch.randn(11, 48, requires_grad=True)  # the trainer: an autograd tensor's views
    g, u = fused.split(24, dim=-1)
    with torch.inference_mode():
        alias = storage_alias(u)
    assert (alias.shape, alias.stride(), alias.storage_offset()) == (u.shape, u.stride(), u.storage_offset())
    assert torch.equal(alias, u) and alias.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()
    assert alias.is_inference() and not u.is_inference() and not storage_alias(alias).is_inference()
    call = as_the_engine_calls(fn, glue.ROW_ARGS["gelu_mul"])
    out = call(g.detach(), u.detach())
    assert torch.allclose(out, glue.gelu_mul(g, u).detach(), atol=1e-6) and not out.is_inference()
    assert torch.equal(call(gate, up), want)
    assert counter.count == graphs, "the trainer's call compiled the glue again"


def test_the_invariant_engine_on_a_gpu_compiles_its_glue():
    """Eager torch norms on a GPU reduce a row in an order that depends on the row count (on the H200:
    scored logprobs 0.15 nats from the rollout's with engine.compile=false)."""
    from flexgemma import ConfigError, compose
    from flexgemma.config.compose import to_config
    from flexgemma.config.resolve import resolve

    cfg = to_config(compose(["+model=tiny", INV, "engine.compile=false"]))
    with pytest.raises(ConfigError, match="engine.compile"):
        resolve(cfg, torch.device("cuda"))
    assert resolve(cfg, torch.device("cpu")).batch_invariant  # the CPU's eager glue pads its rows instead


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_gradient_checkpointing_changes_no_gradient(model):
    """task.gradient_checkpointing for the engine's forward: each layer recomputed in the backward, or
    its ops' inputs kept; the logprobs and every LoRA gradient are the same bits either way."""
    eng = make_engine(INV, "lora=r16", model=model)
    ps, outs = rollout(eng, n=4, new=8)
    seqs, firsts = [p + o.token_ids for p, o in zip(ps, outs)], [len(p) for p in ps]
    for p in eng.lora.slots.values():
        p.requires_grad_(True)
    got = {}
    for checkpoint in (True, False):
        tf = TrainableForward(eng.runner.forward, eng.lora, checkpoint=checkpoint)
        runs, layer = [0], tf.forward.layer

        def counted(*args, **kwargs):
            runs[0] += 1
            return layer(*args, **kwargs)

        tf.forward.layer = counted
        lps, _ = tf.token_logprobs(seqs, firsts)
        sum((lp * (1 + i)).sum() for i, lp in enumerate(lps)).backward()
        got[checkpoint] = ([lp.tolist() for lp in lps], {k: p.grad.clone() for k, p in eng.lora.slots.items()}, runs[0])
        for p in eng.lora.slots.values():
            p.grad = None
    layers = len(eng.spec.layers)
    assert got[True][2] == 2 * layers and got[False][2] == layers  # recomputed in the backward, or not
    assert got[True][0] == got[False][0] == [o.logprobs for o in outs]
    assert all(torch.equal(got[True][1][k], got[False][1][k]) for k in got[True][1])


# the backward's references: the glue's functions op by op, the attention and experts in float32
REFERENCE_BACKWARD = {"trainer_glue_backward": "eager", "trainer_backward_dtype": "float32"}


def _lora_grads(eng, seqs, firsts, **keys):
    """(the logprobs, each LoRA factor's gradient, graphs compiled meanwhile) of the trainer's forward with
    the kernels.trainer_* keys `keys`."""
    import dataclasses

    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    tf = TrainableForward(eng.runner.forward, eng.lora, kernels=dataclasses.replace(eng.runner.forward.kernels, **keys))
    lps, _ = tf.token_logprobs(seqs, firsts)
    sum((lp * (1 + i)).sum() for i, lp in enumerate(lps)).backward()
    grads = {k: p.grad.clone() for k, p in eng.lora.slots.items()}
    for p in eng.lora.slots.values():
        p.grad = None
    return [lp.tolist() for lp in lps], grads, counters["stats"]["unique_graphs"] - graphs


def _relative_errors(got: dict, want: dict) -> float:
    return max(((got[k] - want[k]).abs().max() / (want[k].abs().max() + 1e-12)).item() for k in want)


def _fast_backward_check(eng, fast_keys: dict, tolerance: float):
    """The logprobs of the trainer's forward with and without the kernels.trainer_* keys `fast_keys` are
    the engine's bits; the LoRA gradients with them within `tolerance` of the eager float32 references'
    (relative to each factor's largest); returns (the gradients without, with)."""
    ps, outs = rollout(eng, n=4, new=8)
    seqs, firsts = [p + o.token_ids for p, o in zip(ps, outs)], [len(p) for p in ps]
    for p in eng.lora.slots.values():
        p.requires_grad_(True)
    lps, base, graphs = _lora_grads(eng, seqs, firsts, **REFERENCE_BACKWARD)
    assert lps == [o.logprobs for o in outs] and graphs == 0
    lps, fast, graphs = _lora_grads(eng, seqs, firsts, **{**REFERENCE_BACKWARD, **fast_keys})
    assert lps == [o.logprobs for o in outs]
    assert (graphs > 0) == (fast_keys.get("trainer_glue_backward") == "compiled")  # the glue's backward compiled
    assert _relative_errors(fast, base) <= tolerance, fast_keys
    return base, fast


def test_the_glue_backward_references_are_glues_own_functions_or_their_compiled_wrappers():
    """kernels.trainer_glue_backward as resolved (auto is compiled on a GPU, eager on the CPU:
    tests/test_kernels_group.py): eager hands glue's functions, compiled torch.compile's wrappers (nothing
    compiles until a call); a hand-built Kernels()'s unresolved auto runs torch's ops, as its other autos."""
    from flexgemma.model import glue
    from flexgemma.model.trainable import glue_references

    own = {name: getattr(glue, name) for name in glue.ROW_ARGS}
    assert glue_references("eager") == own and glue_references("auto") == own
    compiled = glue_references("compiled")
    assert compiled.keys() == own.keys() and all(compiled[k] is not own[k] for k in own)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_the_head_gradient_a_vocabulary_slice_at_a_time_is_autograds(softcap):
    """head_slice_grad over the slices of a vocabulary (targets in the first, a middle and the last, one
    on a slice's edge) is autograd's gradient of sum g log_softmax(cap(h))[target] with respect to h."""
    from flexgemma.model.trainable import head_slice_grad

    torch.manual_seed(0)
    n, v, width = 5, 40, 16
    h = torch.randn(n, v) * 30
    targets, g = torch.tensor([0, 15, 16, 39, 7]), torch.randn(n)
    leaf = h.clone().requires_grad_()
    z = leaf if softcap is None else torch.tanh(leaf / softcap) * softcap
    (torch.log_softmax(z, -1).gather(1, targets[:, None])[:, 0] * g).sum().backward()
    lse = torch.logsumexp(z.detach(), -1)
    ours = torch.cat([head_slice_grad(h[:, v0: v0 + width], lse, g, targets - v0, softcap)
                      for v0 in range(0, v, width)], 1)
    assert torch.allclose(ours, leaf.grad, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_the_compiled_glue_backward_gives_the_references_gradients():
    """kernels.trainer_glue_backward=compiled differentiates the glue's own functions through torch.compile:
    in float32 the LoRA gradients are the eager references' up to the order of the sums. The model's dtype
    for the attention's and experts' backward is float32 here: the same gradients bit for bit."""
    eng = make_engine(INV, "lora=r16", "model.dtype=float32", "lora.init_std_b=0.05", model="tiny")
    _fast_backward_check(eng, {"trainer_glue_backward": "compiled"}, 1e-4)
    base, same = _fast_backward_check(eng, {"trainer_backward_dtype": "model_dtype"}, 0.0)
    assert all(torch.equal(base[k], same[k]) for k in base)


@pytest.mark.parametrize("model, extra", [("tiny_moe", []), ("tiny_moe", ["quant=bnb4"]), ("tiny", [])],
                         ids=["moe_bf16", "moe_bnb4", "dense_merged"])
def test_the_bf16_backward_maths_move_the_gradients_by_rounding_only(model, extra):
    """kernels.trainer_backward_dtype=model_dtype on a bf16 model with LoRA (bf16 experts: theirs too): the
    attention, the routed experts (grouped, adapters in their low-rank form) and the merged adapters' factors
    differentiated in bf16; the logprobs are the engine's bits and the gradients within bf16 rounding of the
    float32 references' (and not equal to them)."""
    if extra:
        pytest.importorskip("bitsandbytes")
    eng = make_engine(INV, "lora=r16", "model.dtype=bfloat16", "lora.init_std_b=0.05", *extra, model=model)
    base, low = _fast_backward_check(eng, {"trainer_backward_dtype": "model_dtype"}, 0.1)
    assert any(not torch.equal(low[k], base[k]) for k in base)


@pytest.mark.parametrize("model, dtype, tolerance", [("tiny", "float32", 1e-4), ("tiny", "bfloat16", 0.1),
                                                     ("tiny_moe", "bfloat16", 0.0)])
def test_layers_recomputed_by_reference_keep_the_logprobs_and_move_the_gradients_by_rounding(model, dtype, tolerance):
    """kernels.trainer_recompute=reference: a checkpointed dense layer's recomputation in the backward runs
    torch's products and the references' maths instead of the engine's kernels (fewer of the engine's
    product calls in the backward), the logprobs stay the engine's bits and the LoRA gradients within
    rounding; MoE layers (all of tiny_moe's) recompute with the engine's kernels, so they route as their
    first forward did and give the same gradients bit for bit."""
    import dataclasses

    eng = make_engine(INV, "lora=r16", f"model.dtype={dtype}", "lora.init_std_b=0.05", model=model)
    _fast_backward_check(eng, {"trainer_recompute": "reference"}, tolerance)
    ps, outs = rollout(eng, n=3, new=6)
    seqs, firsts = [p + o.token_ids for p, o in zip(ps, outs)], [len(p) for p in ps]
    calls = {"n": 0}
    product = eng.runner.forward.invariant

    def counted(x, w):
        calls["n"] += 1
        return product(x, w)

    backward_calls = {}
    for how in ("engine", "reference"):
        kernels = dataclasses.replace(eng.runner.forward.kernels, **REFERENCE_BACKWARD, trainer_recompute=how)
        eng.runner.forward.invariant = counted
        try:
            tf = TrainableForward(eng.runner.forward, eng.lora, kernels=kernels)
        finally:
            eng.runner.forward.invariant = product
        lps, _ = tf.token_logprobs(seqs, firsts)
        assert [lp.tolist() for lp in lps] == [o.logprobs for o in outs]
        first_routing = list(tf.forward._routing or [])
        calls["n"] = 0
        torch.stack([lp.sum() for lp in lps]).sum().backward()
        backward_calls[how] = calls["n"]
        if first_routing:  # each MoE layer recomputed (last first) appended the experts it routed to
            again = tf.forward._routing[len(first_routing):]
            assert len(again) == len(first_routing)
            assert all(torch.equal(a, b) for a, b in zip(again, reversed(first_routing)))
    if model == "tiny":
        assert backward_calls["reference"] < backward_calls["engine"], backward_calls
    else:
        assert backward_calls["reference"] == backward_calls["engine"], backward_calls


def test_dense_layers_recompute_by_reference_and_moe_layers_by_the_engine():
    """Recompute.contexts: with trainer_recompute=reference a dense layer's recomputation is marked active
    (its ops pick their references) and the mark goes after; an MoE layer's never is (its router must pick
    the experts it picked); with engine no layer's is."""
    from types import SimpleNamespace

    from flexgemma.model.trainable import Recompute

    dense, moe = SimpleNamespace(moe=False), SimpleNamespace(moe=True)
    r = Recompute("reference")
    ops = r.pick(lambda: "engine", lambda: "reference")
    first, again = r.contexts(dense)
    with first:
        assert ops() == "engine"
    with again:
        assert r.active and ops() == "reference"
    assert not r.active and ops() == "engine"
    with r.contexts(moe)[1]:
        assert ops() == "engine"
    engine = Recompute("engine")
    with engine.contexts(dense)[1]:
        assert engine.pick(lambda: "engine", lambda: "reference")() == "engine"


@pytest.mark.parametrize("packed, t", [(False, 11), (True, 11), (True, 2)], ids=["dense", "4bit", "4bit_few_rows"])
def test_the_grouped_experts_reference_is_the_loops_maths(packed, t):
    """The model_dtype experts' backward maths (moe.experts_grouped with the adapters' low-rank terms: pairs
    sorted once, a grouped product a projection; 4-bit experts dequantised, all of them, or with fewer pairs
    than experts the routed ones and unused padding, their adapters' factors picked by id) equal the float32
    loop's, values and gradients, in float32."""
    import flexgemma.model.trainable as T

    g = torch.Generator().manual_seed(3)
    e, h, i, k, r = 6, 16, 8, 2, 4
    x = torch.randn(t, h, generator=g, requires_grad=True)
    routable = torch.tensor([0, 1, 3, 4, 5])  # expert 2: never routed (the 4-bit groups skip it)
    top = torch.stack([routable[torch.randperm(5, generator=g)[:k]] for _ in range(t)])
    weights = torch.rand(t, k, generator=g, requires_grad=True)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    factors = [torch.randn(*shape, generator=g, requires_grad=True)
               for shape in ((e, 2 * i, r), (e, r, h), (e, h, r), (e, r, i))]
    gu, dn = [(factors[0], factors[1], 0.5)], [(factors[2], factors[3], 2.0)]

    class Packed:  # a 4-bit experts weight's interface: its shape, the chosen experts' matrices
        def __init__(self, w):
            self.w, self.shape = w, w.shape

        def dequantize(self, ids):
            return self.w if ids is None else self.w[ids]

    wu, wd = (Packed(gate_up), Packed(down)) if packed else (gate_up, down)
    act = torch.nn.functional.gelu
    got = T._experts_grouped_reference(x, top, weights, wu, wd, act, gu, dn)
    want = T._experts_reference(x, top, weights, wu, wd, act, gu, dn)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    up = torch.randn(t, h, generator=g)
    for a, b in zip(torch.autograd.grad(got, [x, weights, *factors], up),
                    torch.autograd.grad(want, [x, weights, *factors], up)):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_the_attention_reference_computes_in_the_dtype_it_is_given(monkeypatch):
    import torch.nn.functional as F

    import flexgemma.model.trainable as T

    seen, sdpa = [], F.scaled_dot_product_attention

    def recorded(q, *args, **kwargs):
        seen.append(q.dtype)
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(T.F, "scaled_dot_product_attention", recorded)
    rows = T.PackedRows([0, 5], [5, 4], torch.cat([torch.arange(5), torch.arange(4)]), None)
    q, k, v = (torch.randn(9, h, 8, dtype=torch.bfloat16) for h in (4, 2, 2))
    f32, own = T._attention_reference(q, k, v, rows), T._attention_reference(q, k, v, rows, None)
    assert seen == [torch.float32, torch.bfloat16] and f32.dtype == own.dtype == torch.bfloat16
    assert (f32.float() - own.float()).abs().max() < 0.05


@pytest.mark.parametrize("window", [None, 4])
def test_the_attention_reference_batches_sequences_as_it_would_run_them_alone(monkeypatch, window):
    """The backward's attention maths over sequences padded into batches equals it sequence by sequence
    (a budget of 1 score: each sequence alone), values and gradients, sliding or not."""
    import flexgemma.model.trainable as T

    lengths = [5, 9, 3, 12]
    starts = [0, 5, 14, 17]
    positions = torch.cat([torch.arange(n) for n in lengths])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(29, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    up = torch.randn(29, 4, 8, generator=g)
    got = {}
    for budget in (1, T._REFERENCE_SCORES):
        monkeypatch.setattr(T, "_REFERENCE_SCORES", budget)
        rows = T.PackedRows(starts, lengths, positions, window)
        out = T._attention_reference(q, k, v, rows)
        got[budget] = (len(rows.batches(4)), out, torch.autograd.grad(out, (q, k, v), up))
    (n1, alone, g1), (n2, batched, g2) = got.values()
    assert (n1, n2) == (4, 1)
    for start, n in zip(starts, lengths):  # each sequence's own softmax attention, written out
        qs, ks, vs = (t[start: start + n].detach().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0)
        scores = qs @ ks.transpose(1, 2)
        pos = torch.arange(n)
        allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - (window or n))
        want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vs
        assert torch.allclose(alone[start: start + n].detach(), want.transpose(0, 1), atol=1e-5)
    assert torch.allclose(alone, batched, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g1, g2))


# -- the GPU: every model's shapes, fewer layers ------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("model, extra", [("e2b", ["lora=r32"]), ("26b_a4b", ["quant=bnb4", "lora=r16"]),
                                          ("26b_a4b", ["lora=r16"])], ids=["e2b_r32", "26b_bnb4_r16", "26b_r16"])
def test_gpu_trainer_logprobs_are_the_engines_bit_for_bit(model, extra):
    from conftest import GPU_SHAPES
    from flexgemma import build_engine, compose

    eng = build_engine(compose([f"+model={model}", INV, "device=cuda", "engine.max_batch_size=16",
                                "engine.max_model_len=1024", "cudagraph.buckets=[2,16]", *GPU_SHAPES[model], *extra]))
    check_bitwise(eng)
    # a GRPO micro-batch's scale: 16 sequences of 64-128 + 160 tokens (3-5k rows, KV past one 256-token chunk)
    check_bitwise(eng, n=16, seed=2, new=160, lo=64, hi=129)


@pytest.mark.gpu
@pytest.mark.parametrize("model, extra", [("e2b", ["lora=r32"]), ("26b_a4b", ["quant=bnb4", "lora=r16"])],
                         ids=["e2b_r32", "26b_bnb4_r16"])
def test_gpu_fast_backward_keys_keep_the_logprobs_and_the_gradients(model, extra):
    """The kernels.trainer_* backward keys at the real shapes (E2B's 512-wide full-attention heads, 26B-A4B's
    4-bit experts with LoRA): the engine's logprobs, gradients within bf16 rounding of the float32 eager ones;
    also with the dense layers recomputed by reference (trainer_recompute; 26B-A4B's layers are all MoE)."""
    from conftest import GPU_SHAPES
    from flexgemma import build_engine, compose

    eng = build_engine(compose([f"+model={model}", INV, "device=cuda", "engine.max_batch_size=16",
                                "engine.max_model_len=1024", "cudagraph.buckets=[2,16]", "lora.init_std_b=0.05",
                                *GPU_SHAPES[model], *extra]))
    fast = {"trainer_glue_backward": "compiled", "trainer_backward_dtype": "model_dtype"}
    _fast_backward_check(eng, fast, 0.1)
    _fast_backward_check(eng, {**fast, "trainer_recompute": "reference"}, 0.1)


def _reference_grads(shared, seqs, firsts, weights):
    """transformers' forward (peft's adapters live over the pristine weights), one sequence at a time."""
    model = shared.peft_model
    total = 0.0
    for seq, f0, w in zip(seqs, firsts, weights):
        ids = torch.tensor([seq])
        logits = model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits[f0 - 1: len(seq) - 1], -1).gather(-1, ids[0, f0:, None])[:, 0]
        total = total + (lp * w).sum()
    total.backward()
    return {k: p.grad.clone() for k, p in shared.lora.slots.items()}


@pytest.mark.parametrize("model, extra", [("tiny", []), ("tiny_moe", []), ("tiny", ["lora.merge=false"]),
                                          ("tiny_moe", ["quant=bnb4", "lora.experts=false"])],
                         ids=["tiny_merged", "tiny_moe_merged_experts", "tiny_unmerged", "tiny_moe_bnb4"])
def test_lora_gradients_match_transformers(model, extra):
    from flexgemma.rl.shared import SharedModel

    eng = make_engine(INV, "model.dtype=float32", "lora=r16", "lora.init_std_b=0.05", *extra, model=model)
    ps, outs = rollout(eng, n=4, new=8)
    seqs, firsts = [p + o.token_ids for p, o in zip(ps, outs)], [len(p) for p in ps]
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(len(s) - f, generator=g) for s, f in zip(seqs, firsts)]
    shared = SharedModel(eng, engine_forward=True)
    tf = TrainableForward(eng.runner.forward, eng.lora)
    shared.merged_for_training()
    lps, _ = tf.token_logprobs(seqs, firsts)
    sum((lp * w).sum() for lp, w in zip(lps, weights)).backward()
    ours = {k: p.grad.clone() for k, p in shared.lora.slots.items()}
    for p in shared.lora.slots.values():
        p.grad = None
    shared.engine_forward = False
    shared.trainer_view()  # transformers' forward: pristine weights, peft's adapters live
    theirs = _reference_grads(shared, seqs, firsts, weights)
    assert set(ours) == set(theirs) and len(ours) > 0
    for k in ours:
        scale = theirs[k].abs().max().item() + 1e-12
        assert (ours[k] - theirs[k]).abs().max().item() <= 1e-3 * scale, k


# -- task=grpo with task.trainer_forward=engine -------------------------------------------------
EXACT = ["lora=r16", "task=grpo", "device=cpu", "logger=none", "workload.max_prompt_len=16",
         "model.hf_config.initializer_range=0.2", "task.learning_rate=2e-2", INV, "task.trainer_forward=engine"]


def _rows(path):
    import json

    return [json.loads(line) for line in open(path / "metrics.jsonl")]


@pytest.mark.parametrize("model, dtype, ratio_forward", [("tiny", "float32", "loss"), ("tiny_moe", "bfloat16", "loss"),
                                                          ("tiny_moe", "bfloat16", "separate")])
def test_grpo_trainer_and_rollout_agree_exactly(tmp_path, model, dtype, ratio_forward):
    from flexgemma import compose
    from flexgemma.run.job import run_job

    summary = run_job(compose([f"+model={model}", *EXACT, f"model.dtype={dtype}", "task.steps=3", "task.micro_batch=4",
                               f"task.ratio_forward={ratio_forward}"]), tmp_path)
    assert summary["status"] == "ok" and summary["grpo/trainer_forward"] == "engine"
    assert summary["grpo/gradient_checkpointing"] is True  # null: on for the engine's forward
    assert summary["grpo/ratio_forward"] == ratio_forward
    rows = _rows(tmp_path)
    assert len(rows) == 3
    for r in rows:  # every step, every token: the importance ratios are exactly 1
        assert r["grpo/logprob_absdiff_max"] == 0.0 and r["grpo/kl_k3"] == 0.0 and r["grpo/is_ratio_max"] == 1.0
        if model == "tiny_moe":
            assert r["grpo/router_flip_rate"] == 0.0


def test_the_loss_forwards_ratio_trains_as_the_separate_forwards(tmp_path, monkeypatch):
    """task.ratio_forward=loss reads the IS ratio off each micro-batch's loss forward. With the trainer's
    logprobs moved off the rollout's by a fixed amount per token (so that the ratios are not all 1), it trains
    the same adapter bit for bit and reports the same mismatch as a separate no-grad forward after each rollout."""
    from safetensors.torch import load_file

    from flexgemma import compose
    from flexgemma.rl import rollout
    from flexgemma.run.job import run_job

    real = rollout.engine_logps

    def moved(forward, shared, input_ids, attention_mask, keep, *args, **kwargs):
        lps, ents, aux = real(forward, shared, input_ids, attention_mask, keep, *args, **kwargs)
        return lps + 0.3 * torch.sin(input_ids[:, -keep:].to(lps.dtype)), ents, aux

    monkeypatch.setattr(rollout, "engine_logps", moved)
    out = {}
    for mode in ("separate", "loss"):
        d = tmp_path / mode
        run_job(compose(["+model=tiny", *EXACT, "model.dtype=float32", "task.steps=2", "task.micro_batch=4",
                         f"task.ratio_forward={mode}"]), d)
        out[mode] = (load_file(str(next((d / "adapter").glob("*.safetensors")))), _rows(d))
    (a, rows_a), (b, rows_b) = out["separate"], out["loss"]
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert len(rows_a) == len(rows_b) == 2
    for ra, rb in zip(rows_a, rows_b):
        assert ra["grpo/logprob_absdiff_max"] > 0.1 and ra["grpo/is_ratio_max"] > 1.1  # the ratios are not all 1
        for k in ("grpo/logprob_absdiff_mean", "grpo/logprob_absdiff_max", "grpo/kl_k3", "grpo/is_ratio_max",
                  "grpo/is_ratio_p99"):
            assert ra[k] == rb[k], k


def test_engine_sleep_between_rollouts_trains_the_same_adapter(tmp_path):
    """task.engine_sleep=true gives the KV cache back after each rollout and takes it again before the next:
    the same adapter bit for bit and the same exact metrics as without it (the trainer's forward, here also a
    separate no-grad one after each rollout, needs none of the engine's pool), a wake logged from the second
    step on, and the engine awake at the end."""
    from safetensors.torch import load_file

    from flexgemma import ConfigError, compose
    from flexgemma.run.job import run_job

    out = {}
    for sleep in (False, True):
        d = tmp_path / str(sleep)
        s = run_job(compose(["+model=tiny", *EXACT, "model.dtype=float32", "task.steps=3", "task.micro_batch=4",
                             "task.ratio_forward=separate", f"task.engine_sleep={str(sleep).lower()}"]), d)
        assert s["status"] == "ok" and s["grpo/engine_sleep"] is sleep
        out[sleep] = (load_file(str(next((d / "adapter").glob("*.safetensors")))), _rows(d))
    (a, rows_a), (b, rows_b) = out[False], out[True]
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    for ra, rb in zip(rows_a, rows_b):
        assert rb["grpo/logprob_absdiff_max"] == 0.0 and rb["grpo/is_ratio_max"] == 1.0
        assert ra["grpo/reward_mean"] == rb["grpo/reward_mean"]
    assert "grpo/wake_ms" not in rows_a[0] and rows_b[0]["grpo/wake_ms"] == 0.0
    assert all(r["grpo/wake_ms"] > 0 for r in rows_b[1:])
    with pytest.raises(ConfigError, match="task.generator=flexgemma"):
        compose(["+model=tiny", "task=grpo", "task.generator=trl", "task.engine_sleep=true"])


def test_a_failed_step_leaves_the_sleeping_engine_awake(tmp_path, monkeypatch):
    """task.engine_sleep: a reward that raises in step 2 (the engine asleep since step 1's rollout) stops the
    run with its error, and the engine serves again afterwards."""
    from flexgemma import build_engine, compose
    from flexgemma.engine.sequence import SamplingParams
    from flexgemma.tasks import grpo
    from flexgemma.run.tracking import RunRecorder
    from flexgemma.tasks.workload import build_workload

    def reward(completion_ids, **kw):
        if grpo_step[0] == 2:
            raise RuntimeError("the reward service is down")
        return [0.0] * len(completion_ids)

    grpo_step = [0]
    real = grpo.RecordedReward.__call__

    def counted(self, **kw):
        grpo_step[0] = self.step
        return real(self, **kw)

    monkeypatch.setattr(grpo.RecordedReward, "__call__", counted)
    monkeypatch.setattr(grpo, "make_reward", lambda cfg: grpo.RecordedReward(reward))
    cfg = compose(["+model=tiny", *EXACT, "model.dtype=float32", "task.steps=3", "task.engine_sleep=true"])
    engine = build_engine(cfg, grpo.pool_demand(cfg))
    recorder = RunRecorder(tmp_path, cfg)
    with pytest.raises(RuntimeError, match="reward service is down"):
        grpo.run(engine, build_workload(cfg, engine), cfg, recorder)
    recorder.close()
    assert not engine.asleep
    assert len(engine.generate([[2, 5, 9]], SamplingParams(max_new_tokens=3))[0].token_ids) == 3


def test_ratio_forward_loss_needs_the_engines_forward():
    from flexgemma import ConfigError, compose

    with pytest.raises(ConfigError, match="task.trainer_forward=engine"):
        compose(["+model=tiny", "task=grpo", "task.ratio_forward=loss"])
    with pytest.raises(ConfigError, match="separate or loss"):
        compose(["+model=tiny", "task=grpo", "task.ratio_forward=both"])
    assert compose(["+model=tiny", "task=grpo", *EXACT[-2:]]).task.ratio_forward == "loss"
    assert compose(["+model=tiny", "task=grpo"]).task.ratio_forward == "separate"


@pytest.mark.slow
def test_grpo_with_the_engines_forward_learns(tmp_path):
    from flexgemma import compose
    from flexgemma.run.job import run_job

    # 20 steps: the reward takes off somewhere in steps 8-14 depending on torch's random streams
    summary = run_job(compose(["+model=tiny", *EXACT, "model.dtype=float32", "task.steps=20"]), tmp_path)
    assert summary["grpo/reward_last5"] - summary["grpo/reward_first5"] >= 0.25, summary
    assert summary["grpo/logprob_absdiff_max"] == 0.0


def test_trainer_forward_engine_needs_the_invariant_engine():
    from flexgemma import ConfigError, compose

    with pytest.raises(ConfigError, match="engine.batch_invariant=true"):
        compose(["+model=tiny", "task=grpo", "task.trainer_forward=engine"])
    with pytest.raises(ConfigError, match="transformers or engine"):
        compose(["+model=tiny", "task=grpo", "task.trainer_forward=vllm"])


# -- routing: the router flip rate and routing replay (R3) -------------------------------------
def test_routing_replay_routes_the_trainer_as_told():
    import numpy as np

    eng = make_engine(INV, "model.dtype=float32", "lora=r16", model="tiny_moe")
    g = torch.Generator().manual_seed(31)
    ps = [torch.randint(3, 500, (int(k),), generator=g).tolist() for k in (9, 17, 30)]
    outs = eng.generate(ps, [SamplingParams(max_new_tokens=6, seed=i, ignore_eos=True, return_routed_experts=True)
                             for i in range(3)])
    seqs, firsts = [p + o.token_ids for p, o in zip(ps, outs)], [len(p) for p in ps]
    tf = TrainableForward(eng.runner.forward, eng.lora)
    plain, _ = tf.token_logprobs(seqs, firsts)
    assert all(np.array_equal(a, o.routed_experts) for a, o in zip(tf.last_routed, outs))  # its own routing
    same, _ = tf.token_logprobs(seqs, firsts, replay=[o.routed_experts for o in outs])
    assert all(torch.equal(a, b) for a, b in zip(plain, same))  # replaying its own routing changes nothing
    other = [(o.routed_experts + 1) % 8 for o in outs]  # every token to other experts
    moved, _ = tf.token_logprobs(seqs, firsts, replay=[other[0], None, other[2]])
    assert np.array_equal(tf.last_routed[0], other[0]) and np.array_equal(tf.last_routed[2], other[2])
    assert np.array_equal(tf.last_routed[1], outs[1].routed_experts)  # not replayed: routes itself
    assert not torch.equal(moved[0], plain[0]) and torch.equal(moved[1], plain[1])


def test_router_flip_rate():
    import numpy as np

    from flexgemma.rl.rollout import router_flip_rate

    a = np.array([[[1, 2], [3, 4]], [[5, 6], [7, 0]]], dtype=np.uint8)  # 2 tokens x 2 layers x top-2
    b = a.copy()
    b[0, 0] = [2, 1]  # the same set in another order: no flip
    b[1, 1] = [7, 1]  # one of four (token, layer) differs
    assert router_flip_rate([(a, b)]) == 0.25 and router_flip_rate([(a, a), (None, a)]) == 0.0
    assert router_flip_rate([]) != router_flip_rate([])  # NaN: nothing to compare


def test_grpo_routing_replay_on_tiny_moe(tmp_path):
    from flexgemma import compose
    from flexgemma.run.job import run_job

    summary = run_job(compose(["+model=tiny_moe", *EXACT, "model.dtype=bfloat16", "task.steps=2",
                               "task.routing_replay=true"]), tmp_path)
    rows = _rows(tmp_path)
    assert [r["grpo/router_flip_rate"] for r in rows] == [0.0, 0.0] and summary["grpo/logprob_absdiff_max"] == 0.0
