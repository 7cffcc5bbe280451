"""The weights the engine runs are the weights the caller set: parameters replaced or changed in
place (through `.data` too, and on inference-mode tensors) are seen before the next request is
admitted or prefilled, or refused by name; update_lora is all-or-nothing (model/watch.py, lora.py)."""

import random

import pytest
import torch
from torch import nn

from flexgemma import SamplingParams
from flexgemma.model.lora import LoraError, MergeTarget
from flexgemma import WeightError
from flexgemma.model.watch import SAMPLES, WeightWatch
from flexgemma.tasks.drift import perturbed

from conftest import make_engine

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [2] + list(range(10, 54))  # 45 tokens: 5 full pages of 8 are cached


def new_values(weight: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(weight.shape, generator=g) * weight.float().std() * 2).to(weight.dtype)


def run_twice(engine):
    """The prompt twice: the second one's full pages come from the prefix cache."""
    engine.generate([PROMPT], GREEDY)
    engine.generate([PROMPT], GREEDY)
    assert engine.stats.prefix_hit_tokens == 40


def set_in_place(engine, name: str, w: torch.Tensor) -> None:
    with torch.no_grad():
        engine.model.get_parameter(name).copy_(w)


@pytest.fixture(scope="module")
def reference():
    """Tokens and logprobs of PROMPT on a fresh engine after an in-place change (seen since issue 16)."""
    cache = {}

    def get(name: str, seed: int):
        if (name, seed) not in cache:
            engine = make_engine()
            set_in_place(engine, name, new_values(engine.model.get_parameter(name), seed))
            out = engine.generate([PROMPT], GREEDY)[0]
            cache[name, seed] = (out.token_ids, out.logprobs)
        return cache[name, seed]

    return get


def replace(engine, name: str, w: torch.Tensor, how: str) -> None:
    module_name, attr = name.rsplit(".", 1)
    module = engine.model.get_submodule(module_name)
    if how == "parameter":
        setattr(module, attr, nn.Parameter(w.clone(), requires_grad=False))
    elif how == "data":
        getattr(module, attr).data = w.clone()
    elif how == "assign":
        module.load_state_dict({**module.state_dict(), attr: w.clone()}, assign=True)
    elif how == "data_copy":
        getattr(module, attr).data.copy_(w)
    else:
        raise ValueError(how)


NAMES = ["model.layers.0.self_attn.q_proj.weight",  # rows of the fused q/k/v weight
         "model.layers.1.mlp.up_proj.weight",  # rows of the fused gate/up weight
         "model.layers.0.mlp.down_proj.weight",  # a plain projection
         "model.layers.1.input_layernorm.weight"]  # read by the compiled glue


@pytest.mark.parametrize("how", ["parameter", "data", "assign", "data_copy"])
@pytest.mark.parametrize("name", NAMES)
def test_a_replaced_or_data_changed_parameter_runs_its_new_values(reference, name, how):
    """`module.weight = nn.Parameter(w)`, `p.data = w`, load_state_dict(assign=True) and
    `p.data.copy_(w)`: the next generate runs w (as an engine changed in place does) and serves no
    page of the old weights; the fused weight keeps its storage (CUDA graphs read its address)."""
    engine = make_engine()
    fused = engine.model.model.layers[0].self_attn.fused_qkv
    ptr = fused.data_ptr()
    run_twice(engine)
    replace(engine, name, new_values(engine.model.get_parameter(name), 7), how)
    got = engine.generate([PROMPT], GREEDY)[0]
    assert engine.stats.prefix_hit_tokens == 0
    assert (got.token_ids, got.logprobs) == reference(name, 7)
    assert engine.model.model.layers[0].self_attn.fused_qkv.data_ptr() == ptr
    param = engine.model.get_parameter(name)
    if "q_proj" in name:  # the Parameter is a view of the fused weight again: later in-place changes are seen
        assert param.data_ptr() == fused.data_ptr()
    with torch.no_grad():
        param.mul_(0.5)
    engine.generate([PROMPT], GREEDY)
    assert engine.stats.prefix_hit_tokens == 0


def test_a_replacement_of_another_shape_or_dtype_is_refused_by_name():
    engine = make_engine()
    q = engine.model.model.layers[0].self_attn.q_proj
    original = q.weight
    want = engine.generate([PROMPT], GREEDY)[0].token_ids
    q.weight = nn.Parameter(torch.zeros(3, 5))
    with pytest.raises(WeightError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight was replaced .* \(3, 5\) "
                                          r"torch\.float32 .* runs it as \(128, 64\) torch\.float32 on cpu \(rows of a fused"):
        engine.generate([PROMPT], GREEDY)
    assert not engine.has_work
    q.weight = nn.Parameter(original.detach().bfloat16())
    with pytest.raises(WeightError, match="torch.bfloat16 tensor"):
        engine.add_request(PROMPT, GREEDY)
    q.weight = original  # put back: runs as before
    assert engine.generate([PROMPT], GREEDY)[0].token_ids == want


def test_a_weight_change_between_add_request_and_the_first_step_is_seen():
    """A queued request is not prefilled from pages cached under the old weights."""
    engine = make_engine()
    run_twice(engine)
    name = NAMES[2]
    w = new_values(engine.model.get_parameter(name), 3)
    rid = engine.add_request(PROMPT, GREEDY)
    set_in_place(engine, name, w)
    outs = []
    while engine.has_work:
        outs += engine.step()
    assert [o.request_id for o in outs] == [rid]
    engine.reset_prefix_cache()
    want = engine.generate([PROMPT], GREEDY)[0]
    assert (outs[0].token_ids, outs[0].logprobs) == (want.token_ids, want.logprobs)


def test_inference_mode_weights_changes_move_the_prefix_version():
    """Tensors made under torch.inference_mode keep no version counter: an in-place change is seen
    through their sampled values, and update_lora moves the version too."""
    from flexgemma import Engine
    from flexgemma.model.load import build_model
    from flexgemma import compose
    from conftest import SMALL

    with torch.inference_mode():
        model, tok, _ = build_model(compose(["+model=tiny", *SMALL]).model, torch.device("cpu"))
    engine = Engine.from_model(model, **{"kv.page_size": 8, "kv.cpu_pages": 80, "engine.max_model_len": 256})
    prefix = engine.scheduler.prefix
    run_twice(engine)
    v0 = prefix.version
    with torch.inference_mode():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    engine.generate([PROMPT], GREEDY)
    assert engine.stats.prefix_hit_tokens == 0 and prefix.version == v0 + 1


def test_update_lora_moves_the_prefix_version():
    engine = make_engine("lora=r16")
    run_twice(engine)
    v0 = engine.scheduler.prefix.version
    engine.update_lora(perturbed(engine.lora.state_dict(), 0.5, seed=1))
    assert engine.scheduler.prefix.version > v0
    engine.generate([PROMPT], GREEDY)
    assert engine.stats.prefix_hit_tokens == 0


def test_a_lora_factor_changed_in_place_is_merged_before_the_next_call():
    """An optimizer step on the adapter's factors without update_lora: the merged weights follow."""
    engine, ref = make_engine("lora=r16"), make_engine("lora=r16")
    new = perturbed(engine.lora.state_dict(), 0.5, seed=2)
    ref.update_lora(new)
    want = ref.generate([PROMPT], GREEDY)[0]
    with torch.no_grad():
        for key, value in new.items():
            engine.model.get_parameter(key.removeprefix("base_model.model.")).copy_(value)
    got = engine.generate([PROMPT], GREEDY)[0]
    assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
    assert engine.lora.merged_digests() == ref.lora.merged_digests()


def test_a_replaced_4bit_weight_or_lora_factor_is_refused():
    engine = make_engine("quant=bnb4", "lora=r16")
    layer = engine.model.model.layers[0]
    base = layer.self_attn.q_proj.base_layer
    original = base.weight
    base.weight = type(original)(original.data.clone(), requires_grad=False, quant_state=original.quant_state)
    with pytest.raises(WeightError, match=r"q_proj\.base_layer\.weight was replaced.*4-bit weight.*new engine"):
        engine.generate([PROMPT], GREEDY)
    base.weight = original
    engine.generate([PROMPT], GREEDY)
    a = layer.self_attn.q_proj.lora_A["default"]
    a.weight = nn.Parameter(a.weight.detach().clone())
    with pytest.raises(WeightError, match=r"lora_A\.default\.weight was replaced.*LoRA factor.*update_lora"):
        engine.generate([PROMPT], GREEDY)


def test_the_trainers_view_of_a_shared_model_is_no_change():
    """rl/shared.py's trainer view (base modules holding Parameters over the pristine copies) is the
    same model: generate() neither refuses it nor copies the pristine values into the merged weights."""
    from flexgemma.rl.shared import SharedModel

    engine = make_engine("lora=r16")
    merged = engine.lora.merged_digests()
    want = engine.generate([PROMPT], GREEDY)[0].token_ids
    shared = SharedModel(engine)  # leaves the trainer's view on
    assert engine.generate([PROMPT], GREEDY)[0].token_ids == want
    assert engine.lora.merged_digests() == merged
    shared.engine_view()


# -- update_lora is all-or-nothing ------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 3, 9])
@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_update_interrupted_at_the_kth_merge_leaves_the_previous_adapter(monkeypatch, k, error):
    engine = make_engine("lora=r16")
    lora = engine.lora
    factors, merged, pristine = lora.state_dict(), lora.merged_digests(), lora.pristine_digests()
    want = engine.generate([PROMPT], GREEDY)[0]
    calls, merge = [0], MergeTarget.merge

    def failing(self, adapters):
        calls[0] += 1
        if calls[0] == k + 1:
            raise error("interrupted")
        merge(self, adapters)

    monkeypatch.setattr(MergeTarget, "merge", failing)
    with pytest.raises(error):
        engine.update_lora(perturbed(factors, 0.5, seed=4))
    monkeypatch.setattr(MergeTarget, "merge", merge)
    assert calls[0] > k + 1  # the restore merged every target again
    assert lora.merged_digests() == merged and lora.pristine_digests() == pristine
    assert all(torch.equal(v, factors[key]) for key, v in lora.state_dict().items())
    got = engine.generate([PROMPT], GREEDY)[0]
    assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)


def test_update_lora_refuses_one_slot_given_twice_and_sparse_tensors():
    engine = make_engine("lora=r16")
    lora = engine.lora
    sd = lora.state_dict()
    merged = lora.merged_digests()
    key = next(k for k in sd if "q_proj.lora_A" in k)
    twice = {**sd, key.removeprefix("base_model.model."): sd[key] * 2}  # the same slot under two spellings
    with pytest.raises(LoraError, match=r"are both .*q_proj\.lora_A\.default.*once"):
        engine.update_lora(twice)
    with pytest.raises(LoraError, match=rf"{key} is a torch.sparse_coo tensor.*to_dense"):
        engine.update_lora({**sd, key: sd[key].to_sparse()})
    assert lora.merged_digests() == merged


# -- the cost of the check ----------------------------------------------------------------------------
def test_the_watch_samples_every_tensor_and_sees_a_whole_tensor_copy():
    """~600 tensors, as E2B's model has: the check looks at each; a `.data.copy_` is seen by its samples.
    (Its cost on this machine's CPU is printed: about 1 ms for 595 tensors.)"""
    import time

    root = nn.Module()
    root.layers = nn.ModuleList(nn.ParameterList([nn.Parameter(torch.randn(64, 64).bfloat16()) for _ in range(17)])
                                for _ in range(35))
    watch = WeightWatch(root)
    assert len(watch.entries) == 595 and all(e.view.numel() == SAMPLES for e in watch.entries)
    t0 = time.perf_counter()
    for _ in range(20):
        assert watch.check() is False
    print(f"WeightWatch.check: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms for 595 tensors")
    target = root.layers[20][3]
    target.data.copy_(torch.randn(64, 64).bfloat16())
    assert watch.check() is True and watch.check() is False
    random.seed(0)


def test_an_adapter_directory_with_a_stray_copy_is_refused(tmp_path):
    import shutil

    engine = make_engine("lora=r16")
    engine.lora.save(tmp_path)
    shutil.copy(tmp_path / "adapter_model.safetensors", tmp_path / "backup.safetensors")
    with pytest.raises(LoraError, match=r"tensor \S+ is in both adapter_model\.safetensors and backup\.safetensors"):
        make_engine("lora=r16", f"lora.path={tmp_path}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_a_replaced_parameter_reaches_the_captured_cuda_graphs(name):
    """On the GPU, with decode graphs captured: a replaced Parameter (new storage) reaches the graphs,
    which read the addresses captured at build: decode tokens equal an engine changed in place."""
    from flexgemma import build_engine, compose

    def engine():
        return build_engine(compose(["+model=tiny", "device=cuda", "kv.max_pages=64", "engine.max_model_len=256",
                                     "engine.max_batch_size=8", "cudagraph.buckets=[1,2,4,8]"]))

    got_engine, want_engine = engine(), engine()
    assert got_engine.runner.graphs is not None
    w = new_values(got_engine.model.get_parameter(name).cpu(), 5).cuda()
    replace(got_engine, name, w, "parameter")
    set_in_place(want_engine, name, w)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    got = got_engine.generate([PROMPT, PROMPT[:9]], params)
    want = want_engine.generate([PROMPT, PROMPT[:9]], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
