"""The `kernels` config group: every key typed and checked once, recorded in config_resolved.yaml,
handed on by resolve() to the one object the constructors read, and its old spellings refused with
the new key named."""

import dataclasses

import pytest
import torch
import yaml

from flexgemma import ConfigError, build_engine, compose
from flexgemma.config.schema import MOVED_KEYS, KernelsConfig
from flexgemma.config.kernels import Kernels
from flexgemma.config.resolve import resolve, resolve_kernels
from flexgemma.run.tracking import RunRecorder

CPU = torch.device("cpu")
# a value other than the default for each key that has no `auto`
OTHER = {"fuse_projections": False, "fused_kv_write": True, "prefill_full_blocks": False, "prefill_page_check": "table", "prefill_attention": "varlen", "linear4bit_max_rows": 32,
         "linear4bit_dequant": "bnb", "moe_sort_above": 0, "moe_fused_max_entries": 16, "moe_dequant": "triton",
         "moe_4bit_prefetch": False, "moe_4bit_weights_first_above": 0, "moe_code_lookup": "select",
         "invariant_k_chunk": 256, "invariant_split_tokens": 512, "invariant_block_n": 32,
         "invariant_split_below_tiles": 0, "invariant_split_sum": "last_program", "invariant_flatten": False, "invariant_loads": "tma",
         "invariant_4bit_subtiles": 1,
         "invariant_4bit_scale": "weights",
         "trainer_vocab_slice": 4096, "trainer_glue_backward": "compiled",
         "trainer_backward_dtype": "float32", "trainer_recompute": "reference"}


def config_keys() -> set[str]:
    return {f.name for f in dataclasses.fields(KernelsConfig)}


def test_the_resolved_object_has_every_key_of_the_group():
    """The constructors' object is the group's dataclass and the decode rows; OTHER covers every key."""
    assert {f.name for f in dataclasses.fields(Kernels)} == config_keys() | {"decode_rows"}
    assert set(OTHER) == config_keys() - {"moe", "linear4bit", "invariant_experts"}


def test_resolve_hands_every_key_on(monkeypatch):
    cfg = compose(["+model=tiny", "device=cpu", *(f"kernels.{k}={str(v).lower()}" for k, v in OTHER.items())])
    k = resolve(cfg, CPU).kernels
    assert {key: getattr(k, key) for key in OTHER} == OTHER
    # auto on the CPU; no flex rows
    assert (k.moe, k.linear4bit, k.invariant_experts, k.decode_rows) == ("grouped_mm", "bnb", "grouped", ())
    default = resolve(compose(["+model=tiny", "device=cpu"]), CPU).kernels
    assert default.trainer_glue_backward == "eager"  # auto: compiled on a GPU only, as engine.compile
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = resolve_kernels(KernelsConfig(), torch.device("cuda"), "dense", 64, False)
    assert (gpu.trainer_glue_backward, gpu.invariant_experts) == ("compiled", "triton")
    assert (default.invariant_loads, gpu.invariant_loads) == ("pointers", "tma")  # auto: tma from sm_90
    assert (default.moe_code_lookup, gpu.moe_code_lookup) == ("table", "prmt")  # auto: PTX on NVIDIA GPUs only
    flex = resolve_kernels(KernelsConfig(), CPU, "flex", 512, quantised=True)
    assert flex.decode_rows == (32, 128, 512) and flex.padded_rows(100) == 128
    with pytest.raises(ValueError, match="at most 512"):
        flex.padded_rows(513)


def test_a_hand_built_object_runs_what_the_default_config_resolves_to_on_the_cpu():
    """Kernels() (tests, kernel benchmarks) has the group's defaults; its autos run torch's kernels."""
    from flexgemma.model.glue import make_ops

    cpu = resolve_kernels(KernelsConfig(), CPU, "dense", 64, quantised=False)
    assert dataclasses.replace(cpu, moe="auto", linear4bit="auto", invariant_experts="auto",
                               trainer_glue_backward="auto", moe_code_lookup="auto", invariant_loads="auto",
                               prefill_attention="auto") == Kernels()
    assert make_ops(None, Kernels()).experts_kernel is None and cpu.moe == "grouped_mm"


def test_every_kernels_key_is_in_config_resolved_yaml(tmp_path):
    cfg = compose(["+model=tiny", "kernels.moe_sort_above=0"])
    RunRecorder(tmp_path, cfg).write_config()
    recorded = yaml.safe_load((tmp_path / "config_resolved.yaml").read_text())["kernels"]
    assert set(recorded) == config_keys() and recorded["moe_sort_above"] == 0


def test_the_engine_reads_its_choices_from_the_config():
    """Each constructor got the resolved object: the mask builder's full blocks, the fused K/V write of
    every layer, the runner's row counts, the routed experts' kernel."""
    engine = build_engine(compose(["+model=tiny_moe", "device=cpu", "kernels.prefill_full_blocks=false",
                                   "kernels.fused_kv_write=true"]))
    runner = engine.runner
    assert runner.masks.full_blocks is False and all(a.fused_kv_write for a in runner.forward.attn)
    assert runner.kernels.prefill_full_blocks is False and runner.forward.attention.kernels is runner.kernels
    assert runner.forward.ops.experts_kernel is None and engine.info["moe_kernel"] == "grouped_mm"


def test_the_engine_records_what_each_auto_key_became():
    """config_resolved.yaml keeps `auto`; the engine's build facts (summary.json's engine/...) say what it became
    on this device, so a run records the kernels it ran."""
    engine = build_engine(compose(["+model=tiny_moe", "device=cpu", "kernels.moe_code_lookup=select"]))
    facts = {k: v for k, v in engine.info.items() if k.startswith("kernels/")}
    assert facts == {"kernels/moe": "grouped_mm", "kernels/linear4bit": "bnb", "kernels/moe_code_lookup": "select",
                     "kernels/invariant_loads": "pointers", "kernels/invariant_experts": "grouped",
                     "kernels/trainer_glue_backward": "eager", "kernels/prefill_attention": "flex"}


def test_the_invariant_engine_hands_its_keys_to_each_kernel():
    """engine.batch_invariant: the products, the routed experts and the attention read the invariant_* keys."""
    engine = build_engine(compose(["+model=tiny_moe", "device=cpu", "engine.batch_invariant=true",
                                   "kernels.invariant_flatten=false", "kernels.invariant_k_chunk=256",
                                   "kernels.invariant_split_tokens=128"]))
    forward = engine.runner.forward
    assert forward.invariant.keywords == {"k_chunk": 256, "split_below_tiles": 48, "flatten": False,
                                          "split_sum": "kernel", "loads": "pointers"}
    assert forward.ops.experts_kernel.flatten is False and forward.ops.experts_kernel.k_chunk == 256
    assert forward.attention.options.flatten is False and forward.attention.options.split_tokens == 128


def test_tma_loads_below_hopper_are_refused_when_the_run_resolves(monkeypatch):
    cuda = torch.device("cuda")
    tma = dataclasses.replace(KernelsConfig(), invariant_loads="tma")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match="kernels.invariant_loads=tma .* sm_80 GPU: use kernels.invariant_loads=pointers"):
        resolve_kernels(tma, cuda, "dense", 64, False)
    assert resolve_kernels(KernelsConfig(), cuda, "dense", 64, False).invariant_loads == "pointers"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kernels(tma, cuda, "dense", 64, False).invariant_loads == "tma"


def test_prefill_attention_auto_is_flash_attention_only_where_it_runs(monkeypatch):
    """auto: varlen with the flex backend on an NVIDIA GPU of sm_80+ and a bf16/fp16 model; flex on the CPU,
    in float32, under the other backends (the batch-invariant one included) and on older GPUs. A value set by
    hand is kept (check_varlen judges it at build)."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    auto = KernelsConfig()
    assert resolve_kernels(auto, cuda, "flex", 64, False, bf16).prefill_attention == "varlen"
    assert resolve_kernels(auto, cuda, "flex", 64, False, torch.float16).prefill_attention == "varlen"
    for device, backend, dtype in ((CPU, "flex", bf16), (cuda, "flex", torch.float32), (cuda, "invariant", bf16),
                                   (cuda, "flex_eager", bf16), (cuda, "dense", bf16)):
        assert resolve_kernels(auto, device, backend, 64, False, dtype).prefill_attention == "flex", (device, backend, dtype)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert resolve_kernels(auto, cuda, "flex", 64, False, bf16).prefill_attention == "flex"
    by_hand = dataclasses.replace(auto, prefill_attention="varlen")
    assert resolve_kernels(by_hand, CPU, "dense", 64, False).prefill_attention == "varlen"
    # the whole resolve on the CPU: auto is flex, and the run records it
    assert resolve(compose(["+model=tiny", "device=cpu"]), CPU).kernels.prefill_attention == "flex"


def test_prmt_off_an_nvidia_gpu_is_refused_when_the_run_resolves():
    cfg = compose(["+model=tiny_moe", "device=cpu", "kernels.moe_code_lookup=prmt"])
    with pytest.raises(ConfigError, match="kernels.moe_code_lookup=prmt runs inline PTX, an NVIDIA GPU's only .*cpu"):
        resolve(cfg, CPU)


@pytest.mark.parametrize("old, new", sorted(MOVED_KEYS.items()))
def test_a_moved_key_names_where_it_lives_now(old, new):
    with pytest.raises(ConfigError, match=f"{old} moved to {new} .*give {new}=true"):
        compose([f"{old}=true"])


@pytest.mark.parametrize("override, needle", [
    ("kernels.moe=cutlass", "kernels.moe='cutlass' is invalid: choose one of auto, grouped_mm, triton"),
    ("kernels.linear4bit_dequant=cublas", "kernels.linear4bit_dequant='cublas' is invalid: choose one of bnb, triton"),
    ("kernels.moe_dequant=gather", "kernels.moe_dequant='gather' is invalid: choose one of bnb, triton"),
    ("kernels.linear4bit_max_rows=-1", "kernels.linear4bit_max_rows=-1 is invalid: at least 0"),
    ("kernels.moe_sort_above=-8", "kernels.moe_sort_above=-8 is invalid: at least 0"),
    ("kernels.trainer_glue_backward=jit", "kernels.trainer_glue_backward='jit' is invalid: choose one of auto, eager, compiled"),
    ("kernels.moe_code_lookup=lut", "kernels.moe_code_lookup='lut' is invalid: choose one of auto, table, select, prmt"),
    ("kernels.trainer_backward_dtype=bf16",
     "kernels.trainer_backward_dtype='bf16' is invalid: choose one of float32, model_dtype"),
])
def test_a_bad_kernels_value_names_the_key_and_what_it_accepts(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace(".", r"\.")):
        compose([override])
