"""LoRA on the CPU: merge parity with the textbook formula and with peft's unmerged forward,
in-place updates, adapter directories, drift, and the errors a bad adapter gives."""

import copy
import json

import pytest
import torch
from peft import get_peft_model, get_peft_model_state_dict

from flexgemma import ConfigError, SamplingParams, compose
from flexgemma.model.load import build_model
from flexgemma.model.lora import LoraError, merge_into
from flexgemma.tasks.drift import perturbed

from conftest import SMALL, make_engine

NEW = 10
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


def prompts(seed=0, lengths=(6, 21)):
    g = torch.Generator().manual_seed(seed)
    return [[2] + torch.randint(3, 512, (n - 1,), generator=g).tolist() for n in lengths]


def lora_engine(model="tiny", *overrides):
    return make_engine("lora=r16", *overrides, model=model)


def peft_reference(engine, *overrides):
    """A fresh copy of the engine's base model (same seed) with the engine's adapters, run the way
    peft runs them: unmerged, every adapter active."""
    cfg = compose([f"+model={engine.info['name']}", *SMALL, *overrides])
    model, _, _ = build_model(cfg.model, torch.device("cpu"))
    lora = engine.lora
    pc = engine.lora.peft_model.peft_config
    pm = get_peft_model(model, copy.deepcopy(pc[lora.adapter_names[0]]), adapter_name=lora.adapter_names[0],
                        autocast_adapter_dtype=False)
    for n in lora.adapter_names[1:]:
        pm.add_adapter(n, copy.deepcopy(pc[n]), autocast_adapter_dtype=False)
    pm.base_model.set_adapter(lora.adapter_names)
    missing, unexpected = pm.load_state_dict(lora.state_dict(), strict=False)
    assert not unexpected and not [k for k in missing if ".lora_" in k]
    return pm


def teacher_forced(model, prompt, generated):
    """Log-probabilities of every next token along prompt + generated (one forward)."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1: -1]


# -- the merge itself ----------------------------------------------------------------------------
def expert_factors(wrapper, adapter):
    """Gemma-4's expert weights are [E, out, in]; peft stores A as [E*r, in] and B as [out, r*E]
    (expert-minor): rebuilt here by hand, independently of peft's own get_delta_factors."""
    a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
    e = wrapper.num_experts
    r = a.shape[0] // e
    return b.reshape(b.shape[0], r, e).permute(2, 0, 1), a.reshape(e, r, a.shape[1])


def hand_factors(t, adapter):
    """(lhs, rhs, scale) of one adapter in the base weight's layout, built by hand from lora_A/lora_B."""
    a, b, s = t.layer.lora_A[adapter].weight, t.layer.lora_B[adapter].weight, t.layer.scaling[adapter]
    if t.weight.dim() == 2:
        return b, a, s
    return (*expert_factors(t.layer, adapter), s)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("adapters", [["default"], ["first", "second"]])
def test_merged_weights_are_pristine_plus_scaled_BA_in_the_same_tensor(dtype, rank, adapters):
    engine = make_engine(f"lora=r{rank}", f"model.dtype={dtype}", f"lora.adapter_names=[{','.join(adapters)}]",
                         model="tiny_moe")
    lora = engine.lora
    assert {t.weight.dim() for t in lora.targets} == {2, 3}, "dense and expert weights are both targeted"
    assert lora.peft_model.base_model.active_adapters == adapters
    fresh, _, _ = build_model(compose(["+model=tiny_moe", *SMALL, f"model.dtype={dtype}"]).model, torch.device("cpu"))
    fresh_params = dict(fresh.named_parameters())
    engine_params = {id(p) for p in engine.model.parameters()}
    for t in lora.targets:
        assert id(t.weight) in engine_params, f"{t.name}: the merge must land in the model's own Parameter"
        assert torch.equal(t.pristine, fresh_params[t.name]), f"{t.name}: the pristine copy is the base weight"
        # textbook W + sum_i s_i B_i A_i, the same way: one addmm / baddbmm over rank-concatenated factors
        parts = [hand_factors(t, n) for n in adapters]
        lhs = torch.cat([b * (s / parts[0][2]) if s != parts[0][2] else b for b, _, s in parts], dim=-1)
        rhs = torch.cat([a for _, a, _ in parts], dim=-2)
        textbook = (torch.addmm if t.weight.dim() == 2 else torch.baddbmm)(t.pristine, lhs, rhs, alpha=parts[0][2])
        assert torch.equal(t.weight, textbook), t.name
        assert not torch.equal(t.weight, t.pristine), f"{t.name}: a random B must change the weight"
        # and peft's own deltas (each B@A, scaled, then summed) agree to rounding
        delta = sum(t.layer.get_delta_weight(n).float() for n in adapters)
        ref = t.pristine.float() + delta
        if dtype == "float32":
            torch.testing.assert_close(t.weight.float(), ref, atol=1e-5, rtol=1e-5)
        else:  # the merged delta against peft's, relative to the delta: bf16 rounding ~0.7%, a 5% scale error 5%
            rel = ((t.weight.float() - t.pristine.float() - delta).norm() / delta.norm()).item()
            assert rel < 0.02, f"{t.name}: merged delta off peft's by {rel:.1%}"
        if len(adapters) == 2:
            one = t.pristine.float() + t.layer.get_delta_weight(adapters[0]).float()
            err = (t.weight.float() - ref).abs().max()
            assert (t.weight.float() - one).abs().max() > 2 * err, "the second adapter contributes"


def test_staged_merge_from_cpu_pristine_equals_the_fused_op():
    torch.manual_seed(0)
    for shape, lhs_shape, rhs_shape in (((48, 40), (48, 8), (8, 40)), ((4, 24, 16), (4, 24, 8), (4, 8, 16))):
        w0 = torch.randn(shape).bfloat16()
        lhs, rhs = torch.randn(lhs_shape).bfloat16(), torch.randn(rhs_shape).bfloat16()
        fused, staged = torch.empty_like(w0), torch.empty_like(w0)
        merge_into(fused, w0, lhs, rhs, 2.0)
        merge_into(staged, w0, lhs, rhs, 2.0, staged=True)
        assert torch.equal(fused, staged)


def test_in_place_merge_unmerge_drifts_but_refresh_from_pristine_does_not():
    """Why flexgemma rebuilds from a pristine copy: W += dW; W -= dW is not the identity in bf16."""
    torch.manual_seed(0)
    pristine = (torch.randn(256, 256) * 0.02).bfloat16()
    b, a = (torch.randn(256, 16) * 0.01).bfloat16(), (torch.randn(16, 256) / 16).bfloat16()
    naive = pristine.clone()
    for _ in range(10):
        delta = (b @ a) * 2.0
        naive += delta
        naive -= delta
    assert not torch.equal(naive, pristine)
    w = torch.empty_like(pristine)
    merge_into(w, pristine, b, a, 2.0)
    first = w.clone()
    for i in range(10):
        merge_into(w, pristine, b * (1 + i), a, 2.0)
    merge_into(w, pristine, b, a, 2.0)
    assert torch.equal(w, first)


# -- generation: merged == peft's unmerged forward ------------------------------------------------
@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("adapters", ["[default]", "[first,second]"])
def test_float32_greedy_tokens_equal_peft_unmerged(model, rank, adapters):
    engine = make_engine(f"lora=r{rank}", f"lora.adapter_names={adapters}", "model.dtype=float32", model=model)
    ref = peft_reference(engine, "model.dtype=float32")
    changed = False
    for p, out in zip(prompts(rank), engine.generate(prompts(rank), GREEDY)):
        lp = teacher_forced(ref, p, out.token_ids)
        assert lp.argmax(-1).tolist() == out.token_ids, "peft's unmerged greedy tokens differ"
        with ref.disable_adapter():
            changed |= teacher_forced(ref, p, out.token_ids).argmax(-1).tolist() != out.token_ids
    assert changed, "the adapter should change the base model's greedy tokens"


# bf16 is slow on a CPU: every pair of (model, rank, adapters) values once (an L4 orthogonal array)
@pytest.mark.parametrize("model, rank, adapters", [
    ("tiny", 16, "[default]"), ("tiny", 64, "[first,second]"),
    ("tiny_moe", 16, "[first,second]"), ("tiny_moe", 64, "[default]"),
])
def test_bfloat16_logprobs_close_to_peft_unmerged(model, rank, adapters):
    """bf16 rounds the merged weight once where peft rounds x@A and (x@A)@B: the two differ by bf16
    noise (which MoE routing amplifies), far less than the adapter's own effect."""
    engine = make_engine(f"lora=r{rank}", f"lora.adapter_names={adapters}", "model.dtype=bfloat16", model=model)
    ref = peft_reference(engine, "model.dtype=bfloat16")
    errs, gaps = [], []
    for p, out in zip(prompts(rank + 1), engine.generate(prompts(rank + 1), GREEDY)):
        tok = torch.tensor(out.token_ids)[:, None]
        errs.append(torch.tensor(out.logprobs) - teacher_forced(ref, p, out.token_ids).gather(-1, tok)[:, 0])
        with ref.disable_adapter():
            gaps.append(torch.tensor(out.logprobs) - teacher_forced(ref, p, out.token_ids).gather(-1, tok)[:, 0])
    err, gap = torch.cat(errs).abs().mean().item(), torch.cat(gaps).abs().mean().item()
    assert err < 0.2 and err < gap / 2, f"mean |logprob| error vs peft {err:.3f}, vs no adapter {gap:.3f}"


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_unmerged_mode_runs_peft_modules_and_equals_merged(model):
    merged = make_engine("lora=r16", model=model)
    unmerged = make_engine("lora=r16", "lora.merge=false", model=model)
    assert unmerged.info["lora_mode"] == "unmerged"
    q = unmerged.model.model.layers[0].self_attn.q_proj
    assert not q.disable_adapters and torch.equal(q.get_base_layer().weight,
                                                  merged.lora.targets[0].pristine)
    a = [o.token_ids for o in merged.generate(prompts(3), GREEDY)]
    b = [o.token_ids for o in unmerged.generate(prompts(3), GREEDY)]
    assert a == b
    new = perturbed(unmerged.lora.state_dict(), 0.5, seed=1)
    merged.update_lora(new)
    unmerged.update_lora(new)
    a = [o.token_ids for o in merged.generate(prompts(3), GREEDY)]
    assert a == [o.token_ids for o in unmerged.generate(prompts(3), GREEDY)]


def test_unmerged_4bit_lora_runs_in_groups_equal_to_peft_modules():
    """quant=bnb4 + lora: the forward runs the adapters as LowRankGroups (q/k/v, gate/up, o, down:
    one GEMM for the group's A factors, an addmm per member) whose outputs equal peft's own modules,
    before and after an update (the groups' factor copies are rebuilt by refresh)."""
    engine = make_engine("quant=bnb4", "lora=r16", model="tiny")
    lora = engine.lora
    assert engine.info["lora_mode"] == "unmerged" and not lora.targets
    layer = engine.model.model.layers[0]
    qkv = next(g for g in lora.groups if g.layers[0] is layer.self_attn.q_proj)
    gate_up = next(g for g in lora.groups if g.layers[0] is layer.mlp.gate_proj)
    assert len(qkv.layers) == 3 and len(gate_up.layers) == 2
    # every adapted projection of every layer runs in a group: none is left to peft's forward
    assert sum(len(g.layers) for g in lora.groups) == len(lora.layers)
    x = torch.randn(5, layer.self_attn.q_proj.in_features, dtype=engine.model.dtype)  # bf16 (4-bit compute)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for step in range(2):
        for got, module in zip(qkv(x), qkv.layers):
            a, b = module.lora_A["default"].weight.float(), module.lora_B["default"].weight.float()
            base = module.get_base_layer()(x)
            exact = base.float() + x.float() @ a.T @ b.T * module.scaling["default"]
            assert rel(exact, base) > 0.05, step  # the adapter moves the output
            assert rel(got, exact) < 1e-2 and rel(module(x), exact) < 1e-2, step  # ours and peft's: bf16 rounding
        engine.update_lora(perturbed(lora.state_dict(), 0.5, seed=step + 1))


# -- update_lora ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_lora():
    return lora_engine("tiny_moe")


def test_update_lora_changes_weights_in_place_and_restores_bit_for_bit(moe_lora):
    engine, lora = moe_lora, moe_lora.lora
    ptrs = [t.weight.data_ptr() for t in lora.targets]
    original, merged0 = lora.state_dict(), lora.merged_digests()
    before = [o.token_ids for o in engine.generate(prompts(5), GREEDY)]
    report = engine.update_lora(perturbed(original, 0.5, seed=3))
    assert set(report) >= {"refresh_ms", "copy_ms", "merge_ms"} and report["tensors"] == len(original)
    assert [t.weight.data_ptr() for t in lora.targets] == ptrs
    assert [o.token_ids for o in engine.generate(prompts(5), GREEDY)] != before
    engine.update_lora(original)
    assert lora.merged_digests() == merged0
    assert [o.token_ids for o in engine.generate(prompts(5), GREEDY)] == before


def test_update_lora_from_a_trainers_peft_model(moe_lora):
    engine = moe_lora
    trainer = peft_reference(engine)  # the trainer's copy, then one "optimizer step" on it
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            if ".lora_" in n:
                p.mul_(1.5)
    original = engine.lora.state_dict()
    engine.update_lora(trainer)
    try:
        for t in engine.lora.targets:
            owner = t.name.rsplit(".", 1)[0] if t.weight.dim() == 2 else None
            if owner:
                layer = trainer.get_submodule("base_model.model." + owner)
                torch.testing.assert_close(t.weight, t.pristine + layer.get_delta_weight("default"),
                                           atol=1e-5, rtol=1e-5)
    finally:
        engine.update_lora(original)


def test_update_lora_accepts_a_saved_adapters_keys(moe_lora):
    engine = moe_lora
    saved = get_peft_model_state_dict(engine.lora.peft_model)  # keys without the adapter name
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in saved)
    merged0 = engine.lora.merged_digests()
    engine.update_lora(saved)
    assert engine.lora.merged_digests() == merged0


def test_update_lora_errors_name_what_is_wrong(moe_lora):
    engine = moe_lora
    sd = engine.lora.state_dict()
    key = next(k for k in sd if "q_proj.lora_A" in k)
    with pytest.raises(LoraError, match=r"shape \(8, 64\).*rank mismatch"):
        engine.update_lora({**sd, key: torch.zeros(8, 64)})
    with pytest.raises(LoraError, match="fit no LoRA layer.*c_attn"):
        engine.update_lora({**sd, "base_model.model.model.layers.0.attn.c_attn.lora_A.default.weight": torch.zeros(1)})
    with pytest.raises(LoraError, match="lacks 1 of the adapter tensors"):
        engine.update_lora({k: v for k, v in sd.items() if k != key})
    with pytest.raises(LoraError, match="not one of the engine's adapters"):
        engine.update_lora(sd, adapter_name="other")
    with pytest.raises(TypeError, match="peft model or a state dict"):
        engine.update_lora([1, 2])


def test_two_adapters_keyless_update_needs_an_adapter_name():
    engine = lora_engine("tiny", "lora.adapter_names=[first,second]")
    saved = get_peft_model_state_dict(engine.lora.peft_model, adapter_name="second")
    with pytest.raises(LoraError, match="pass adapter_name"):
        engine.update_lora(saved)
    first0 = engine.lora.state_dict()
    engine.update_lora(perturbed(saved, 0.5, seed=1), adapter_name="second")
    after = engine.lora.state_dict()
    assert all(torch.equal(after[k], v) == (".first." in k) for k, v in first0.items())


def test_engine_without_lora_says_so(tiny_engine):
    assert tiny_engine.lora is None
    with pytest.raises(RuntimeError, match="without a LoRA adapter"):
        tiny_engine.update_lora({})


# -- adapter directories and config errors ----------------------------------------------------------
def test_adapter_directory_round_trip_and_mismatches(tmp_path, moe_lora):
    moe_lora.lora.save(tmp_path / "moe")
    assert (tmp_path / "moe" / "adapter_model.safetensors").is_file()
    loaded = make_engine(f"lora.path={tmp_path / 'moe'}", model="tiny_moe")
    assert loaded.info["lora_rank"] == 16 and loaded.info["lora_source"] == str(tmp_path / "moe")
    assert loaded.lora.merged_digests() == moe_lora.lora.merged_digests()

    with pytest.raises(LoraError, match=r"lora.rank=32 but the adapter .* has r=16: set lora.rank=16"):
        make_engine("lora=r32", f"lora.path={tmp_path / 'moe'}", model="tiny_moe")
    with pytest.raises(LoraError, match="target parameter 'experts.gate_up_proj' is not a parameter"):
        make_engine(f"lora.path={tmp_path / 'moe'}", model="tiny")  # expert adapter on a dense model
    moe_lora.lora.save(tmp_path / "bad")
    cfg = json.loads((tmp_path / "bad" / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "c_attn"]
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoraError, match=r"target modules \['c_attn'\] match no linear layer"):
        make_engine(f"lora.path={tmp_path / 'bad'}", model="tiny_moe")
    with pytest.raises(LoraError, match="no adapter_config.json"):
        make_engine(f"lora.path={tmp_path}", model="tiny_moe")


def test_adapter_of_another_model_is_a_shape_error(tmp_path):
    small = make_engine("lora=r16", "lora.target_modules=[k_proj]", "lora.experts=false", model="tiny")
    small.lora.save(tmp_path)
    with pytest.raises(LoraError, match=r"k_proj needs \(64, 16\).*layer size mismatch"):
        make_engine(f"lora.path={tmp_path}", model="tiny_moe")  # tiny_moe's k_proj has 2 KV heads


@pytest.mark.parametrize(
    "override, needle",
    [
        (["lora.target_modules=[q_proj,c_attn]"], r"target modules \['c_attn'\] match no linear layer"),
        (["lora.adapter_names=[a]"], "lora.adapter_names"),
        (["lora.dropout=0.1"], "lora.dropout is no longer a key: it was checked and never used"),
        (["lora.alpha=0"], "lora.alpha=0"),
        (["lora.path=/nonexistent/adapter"], "does not exist"),
    ],
)
def test_lora_config_errors(override, needle):
    with pytest.raises((ConfigError, LoraError), match=needle):
        make_engine("lora=r16", *override)


# -- the drift task -----------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [["model.dtype=bfloat16"], ["lora.merge=false"]])
def test_drift_task_reports_bit_identity(tmp_path, extra):
    from flexgemma.run.job import run_job

    cfg = compose(["+model=tiny_moe", *SMALL, "lora=r16", "task=drift", "task.cycles=3", "task.max_prompts=2",
                   "workload.num_prompts=2", "workload.max_new_tokens=6", *extra])
    summary = run_job(cfg, tmp_path)
    assert summary["status"] == "ok"
    assert summary["drift/base_bit_identical"] is True
    assert summary["drift/merge_bit_identical"] is True
    assert summary["drift/inference_deterministic"] is True
    assert summary["drift/cycles_tokens_changed"] >= 1, "the perturbations should reach the tokens"
    assert summary["lora/refresh_ms"] > 0 and summary["engine/lora_refresh_ms"] > 0
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3 + 1


def test_drift_task_without_lora_is_a_clear_error(tmp_path):
    from flexgemma.run.job import run_job

    with pytest.raises(ConfigError, match="task=drift needs a LoRA adapter"):
        run_job(compose(["+model=tiny", *SMALL, "task=drift"]), tmp_path)


@pytest.mark.parametrize("merge", ["true", "false"])
def test_peft_wrapped_modules_trace_as_one_graph(merge):
    """The decode step is compiled with fullgraph=True: peft's wrappers (disabled when merged, active
    when unmerged) and the experts' base lookup in moe.py must not break the graph."""
    engine = lora_engine("tiny_moe", f"lora.merge={merge}")
    layer = engine.model.model.layers[0]

    def step(x):
        experts = layer.experts
        if hasattr(experts, "get_base_layer"):
            experts = experts.get_base_layer()
        return layer.self_attn.o_proj(layer.self_attn.q_proj(x)).sum() + layer.mlp(x).sum() + experts.gate_up_proj.sum()

    torch._dynamo.reset()
    x = torch.randn(5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(torch.compile(step, backend="eager", fullgraph=True)(x), step(x))
