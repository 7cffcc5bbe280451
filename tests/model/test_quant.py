"""quant=bnb4 on the CPU (bitsandbytes' CPU kernels): expert packing, the grouped path on packed
experts, module replacement and the 4-bit fraction, parity with transformers' own bitsandbytes
model on the same packed weights, and pre-quantised checkpoints. GPU versions are marked."""

import pytest
import torch
import torch.nn.functional as F

from flexgemma import SamplingParams, build_engine, compose
from flexgemma.model.moe import experts_grouped, experts_loop
from flexgemma.tasks.parity import hf_greedy

from conftest import SMALL, tiny_multimodal

bnb = pytest.importorskip("bitsandbytes")
from flexgemma.model.quant import (  # noqa: E402
    Bnb4Settings, PackedExperts, PackedExpertWeight, generic_cpu_kernels, storage_census,
)

ACT = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
PROMPTS = [[2, 17, 99, 301, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [2, 40, 41, 42, 43]]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


def bnb4_engine(model: str, *overrides: str):
    # float32 compute: flexgemma and transformers then agree token for token on the same 4-bit weights
    return build_engine(compose([f"+model={model}", "quant=bnb4", "model.dtype=float32", *SMALL, *overrides]))


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", [(8, 64, 64), (8, 64, 32), (4, 32, 128)])
def test_expert_packing_round_trips_within_nf4_error(shape, double_quant):
    torch.manual_seed(0)
    w = torch.randn(*shape)
    packed = PackedExpertWeight.pack(w, Bnb4Settings(double_quant=double_quant, compute_dtype=torch.float32),
                                     torch.device("cpu"))
    full = packed.dequantize()
    rel = ((full - w).norm() / w.norm()).item()
    assert 0.07 < rel < 0.1  # NF4 on Gaussian weights: ~0.092
    # every expert is packed on its own: equal to bitsandbytes quantising that expert alone
    import bitsandbytes.functional as bf

    for e in range(shape[0]):
        q, st = bf.quantize_4bit(w[e].reshape(-1, 64).contiguous(), blocksize=64, quant_type="nf4",
                                 compress_statistics=double_quant)
        assert torch.equal(full[e], bf.dequantize_4bit(q, st).reshape(shape[1:]))
    # gathering experts dequantises exactly those
    sel = torch.tensor([3, 0, 2])
    assert torch.equal(packed.dequantize(sel), full[sel])
    assert packed.storage_bytes() < w.numel() * 2 * 0.3  # vs bf16


@pytest.mark.parametrize("tokens", [1, 3, 64])  # fewer rows than experts (gather) and more (all)
def test_grouped_on_packed_experts_equals_loop_on_dequantised(tokens):
    torch.manual_seed(tokens)
    e, h, i, k = 8, 64, 32, 2
    s = Bnb4Settings(compute_dtype=torch.float32)
    gate_up = PackedExpertWeight.pack(torch.randn(e, 2 * i, h) * 0.1, s, torch.device("cpu"))
    down = PackedExpertWeight.pack(torch.randn(e, h, i) * 0.1, s, torch.device("cpu"))
    x = torch.randn(tokens, h)
    w, idx = torch.softmax(torch.randn(tokens, e), -1).topk(k, dim=-1)
    got = experts_grouped(x, idx, w, gate_up, down, ACT)
    ref = experts_loop(x, idx, w, gate_up.dequantize(), down.dequantize(), ACT)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def _bf16_share(model) -> int:
    """Parameters that stay in the model dtype by design: embeddings, norms, router scales."""
    return sum(p.numel() for n, p in model.named_parameters()
               if "embed" in n or "norm" in n or n.endswith(("router.scale", "per_expert_scale")))


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_linear4bit_replaces_every_linear_and_fraction_is_honest(model):
    ref = build_engine(compose([f"+model={model}", *SMALL])).model
    engine = bnb4_engine(model)
    m = engine.model
    assert not [n for n, mod in m.named_modules() if type(mod) is torch.nn.Linear and n != "lm_head"]
    linears = [n for n, mod in ref.named_modules() if isinstance(mod, torch.nn.Linear) and n != "lm_head"]
    assert all(isinstance(m.get_submodule(n), bnb.nn.Linear4bit) for n in linears)
    assert m.lm_head.weight is m.model.embed_tokens.weight  # tied, bf16
    if model == "tiny_moe":
        assert all(isinstance(layer.experts, PackedExperts) for layer in m.model.layers)
        assert not any("gate_up_proj" in n for n, _ in m.named_parameters())  # bf16 experts freed
    total = sum(p.numel() for p in ref.parameters())
    assert engine.info["params"] == total
    expected = 1 - _bf16_share(ref) / total
    assert engine.info["quant/fraction_4bit"] == pytest.approx(expected)
    ref_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())  # same dtype, unquantised
    assert storage_census(m)["quant/weight_bytes"] < 0.4 * ref_bytes


def test_26b_a4b_fraction_at_least_95_percent_from_the_quantisers_census():
    """The quantiser runs on one 26B-A4B layer at its real widths (2 of its 128 experts, a small
    vocabulary) and its census says what stays unquantised per layer; with the 26B's embedding table
    and 30 layers (counted on the meta device) at least 95% of the parameters are then 4-bit."""
    from transformers import Gemma4ForCausalLM

    from flexgemma.model.load import build_model, text_config_from_dict

    cfg = compose(["+model=26b_a4b", "quant=bnb4", "model.hf_config.num_hidden_layers=1",
                   "model.hf_config.vocab_size=256", "model.hf_config.vocab_size_per_layer_input=256",
                   "model.hf_config.num_experts=2", "model.hf_config.top_k_experts=2"])
    model, _, info = build_model(cfg.model, torch.device("cpu"), cfg.quant)
    with torch.device("meta"):
        small = Gemma4ForCausalLM(text_config_from_dict(cfg.model.hf_config))
        full = Gemma4ForCausalLM(text_config_from_dict(compose(["+model=26b_a4b"]).model.hf_config))
    census = storage_census(model)
    # every 2-D Linear weight (lm_head is the tied embedding) and the 3-D experts are 4-bit; nothing else
    matrices = sum(mod.weight.numel() for n, mod in small.named_modules()
                   if isinstance(mod, torch.nn.Linear) and n != "lm_head")
    experts = sum(p.numel() for n, p in small.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))
                  and p.dim() == 3)
    assert census["params"] == info["params"] == sum(p.numel() for p in small.parameters())
    assert census["quant/params_4bit"] == matrices + experts
    embed = small.model.embed_tokens.weight.numel()
    kept_per_layer = census["params"] - census["quant/params_4bit"] - embed  # norms, scales, router scales
    assert kept_per_layer > 0
    total = sum(p.numel() for p in full.parameters())
    kept = full.model.embed_tokens.weight.numel() + full.config.num_hidden_layers * kept_per_layer
    assert 1 - kept / total >= 0.95


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_bnb4_greedy_equals_transformers_on_the_quantised_model(model):
    engine = bnb4_engine(model, "quant.double_quant=true")
    outs = engine.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == hf_greedy(engine.model, p, GREEDY.max_new_tokens)


@pytest.fixture(scope="module")
def prequantised_multimodal(tmp_path_factory):
    """transformers quantises a tiny multimodal Gemma-4 with bitsandbytes on the CPU and saves it."""
    from transformers import BitsAndBytesConfig, Gemma4ForConditionalGeneration

    bf16 = tmp_path_factory.mktemp("bf16")
    tiny_multimodal(seed=7).save_pretrained(bf16)
    qcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)
    hf = Gemma4ForConditionalGeneration.from_pretrained(bf16, quantization_config=qcfg, device_map="cpu",
                                                        dtype=torch.float32)
    path = tmp_path_factory.mktemp("bnb4")
    hf.save_pretrained(path)
    return path, generic_cpu_kernels(hf.eval())


def test_prequantised_checkpoint_loads_packed_weights_as_they_are(prequantised_multimodal):
    path, hf = prequantised_multimodal
    engine = build_engine(compose(["+model=tiny", f"model.path={path}", "quant=bnb4", "model.dtype=float32", *SMALL]))
    assert engine.info["prequantized"] > 0 and engine.info["skipped"] > 0  # the vision tower was never read
    ours = dict(engine.model.model.named_modules())
    for name, mod in hf.model.language_model.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            assert torch.equal(ours[name].weight.data, mod.weight.data), name
            assert torch.equal(ours[name].weight.quant_state.absmax, mod.weight.quant_state.absmax), name
    # greedy tokens against transformers' own bitsandbytes model (its multimodal wrapper)
    for p, o in zip(PROMPTS, engine.generate(PROMPTS, GREEDY)):
        assert o.token_ids == hf_greedy(hf, p, GREEDY.max_new_tokens)


def test_prequantised_checkpoint_needs_quant_bnb4(prequantised_multimodal):
    from flexgemma.model.load import ModelLoadError

    path, _ = prequantised_multimodal
    with pytest.raises(ModelLoadError, match="quant=bnb4"):
        build_engine(compose(["+model=tiny", f"model.path={path}", *SMALL]))


def test_bf16_checkpoint_quantised_at_load():
    """A bf16 checkpoint with quant=bnb4: quantised tensor by tensor, equal to quantising the
    bf16 engine's weights."""
    import tempfile

    from transformers import Gemma4ForCausalLM

    from flexgemma.model.load import text_config_from_dict

    torch.manual_seed(3)
    m = Gemma4ForCausalLM(text_config_from_dict(compose(["+model=tiny_moe"]).model.hf_config))
    with tempfile.TemporaryDirectory() as d:
        m.save_pretrained(d)
        engine = bnb4_engine("tiny_moe", f"model.path={d}")
    assert engine.info["weights"] != "random" and engine.info["prequantized"] == 0
    got = engine.model.model.layers[1].experts.gate_up_proj.dequantize()
    ref = m.model.layers[1].experts.gate_up_proj.detach()
    assert 0.07 < ((got - ref).norm() / ref.norm()).item() < 0.1
    q = engine.model.model.layers[2].self_attn.q_proj
    deq = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state)
    ref = m.model.layers[2].self_attn.q_proj.weight
    assert 0.07 < ((deq - ref).norm() / ref.norm()).item() < 0.1


def test_peft_wraps_the_4bit_linears_not_the_packed_experts():
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    engine = build_engine(compose(["+model=tiny_moe", "quant=bnb4", *SMALL]))
    before = engine.generate(PROMPTS[:1], GREEDY)[0].token_ids
    get_peft_model(engine.model, LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))  # conf/lora/r16.yaml
    layer = engine.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, LoraLinear4bit) and isinstance(layer.mlp.down_proj, LoraLinear4bit)
    assert isinstance(layer.experts, PackedExperts)  # "down_proj" did not match the packed experts
    # LoRA B starts at zero: the unmerged adapters leave the tokens unchanged
    assert engine.generate(PROMPTS[:1], GREEDY)[0].token_ids == before
    # and the engine runs the wrappers peft injected after its build: a non-zero B moves the logprobs
    base = engine.generate(PROMPTS[:1], GREEDY)[0].logprobs
    with torch.no_grad():
        for m in engine.model.modules():
            if isinstance(m, LoraLinear4bit):
                m.lora_B["default"].weight.normal_(0, 0.5)
    assert engine.generate(PROMPTS[:1], GREEDY)[0].logprobs != base


def test_bad_quant_settings_are_clear():
    from flexgemma.config.schema import ConfigError

    with pytest.raises(ConfigError, match="quant.block_size"):
        build_engine(compose(["+model=tiny", "quant=bnb4", "quant.block_size=48", *SMALL]))


# -- GPU (the H200): the same maths on CUDA kernels, compiled and inside CUDA graphs ---------------
def _gpu_engine(model, *overrides):
    return build_engine(compose([f"+model={model}", "quant=bnb4", "device=cuda", "kv.max_pages=128",
                                 "engine.max_model_len=1024", "engine.max_batch_size=8",
                                 "cudagraph.buckets=[1,2,4,8]", *overrides]))


@pytest.mark.gpu
def test_gpu_packed_grouped_equals_loop():
    torch.manual_seed(0)
    e, h, i, k = 16, 256, 128, 4
    s = Bnb4Settings()
    dev = torch.device("cuda")
    gate_up = PackedExpertWeight.pack((torch.randn(e, 2 * i, h) * 0.05).bfloat16(), s, dev)
    down = PackedExpertWeight.pack((torch.randn(e, h, i) * 0.05).bfloat16(), s, dev)
    for t in (1, 3, 96):
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        w, idx = torch.softmax(torch.randn(t, e, device=dev), -1).topk(k, dim=-1)
        got = experts_grouped(x, idx, w, gate_up, down, ACT).float()
        ref = experts_loop(x, idx, w, gate_up.dequantize(), down.dequantize(), ACT).float()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_gpu_bnb4_graphs_equal_eager_and_transformers(model):
    engine = _gpu_engine(model, "model.dtype=float32")
    assert engine.runner.graphs is not None
    ps = [PROMPTS[0], PROMPTS[1], PROMPTS[0][:9]]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    with_graphs = [o.token_ids for o in engine.generate(ps, sp)]
    assert sum(engine.runner.graphs.hits.values()) > 0
    graphs, engine.runner.graphs = engine.runner.graphs, None
    assert [o.token_ids for o in engine.generate(ps, sp)] == with_graphs
    engine.runner.graphs = graphs
    for p, o in zip(ps, with_graphs):
        assert o == hf_greedy(engine.model, p, 24)


@pytest.mark.gpu
def test_gpu_26b_a4b_bnb4_cli_job_fits_18gb(tmp_path):
    """Issue 6's command as a user runs it, `python -m flexgemma +model=26b_a4b quant=bnb4` (default
    workload, pool sized for it): peak at most 18 GB, at least 95% of the parameters in 4 bits."""
    import json
    import os
    import subprocess
    import sys
    from conftest import ROOT as root

    r = subprocess.run([sys.executable, "-m", "flexgemma", "+model=26b_a4b", "quant=bnb4", "logger=none",
                        f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print({k: v for k, v in summary.items() if k.startswith(("memory/", "quant/", "throughput/", "engine/kv"))})
    assert summary["quant/fraction_4bit"] >= 0.95
    assert summary["memory/peak_allocated_gib"] * 2**30 <= 18e9
