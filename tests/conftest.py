import os

# bitsandbytes' CPU kernels and torch each keep an OpenMP pool; with busy-waiting workers they
# starve each other on few cores (a 4-bit matmul ~300x slower). Set before torch starts its pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from flexgemma import build_engine, compose

ROOT = Path(__file__).resolve().parents[1]  # the repository (this file is tests/conftest.py)

# Small pages and window-sized prompts so every test crosses pages and the sliding window.
SMALL = ["kv.page_size=8", "kv.cpu_pages=80", "engine.max_model_len=256", "device=cpu"]


# every model's real shapes with fewer layers (every layer kind kept): GPU tests that build each model
GPU_SHAPES = {
    "e2b": ["model.hf_config.num_hidden_layers=8", "model.hf_config.num_kv_shared_layers=4",
            "model.hf_config.layer_types=[sliding_attention,sliding_attention,sliding_attention,full_attention,"
            "sliding_attention,sliding_attention,sliding_attention,full_attention]"],
    "e4b": ["model.hf_config.num_hidden_layers=6", "model.hf_config.num_kv_shared_layers=2",
            "model.hf_config.layer_types=[sliding_attention,sliding_attention,full_attention,"
            "sliding_attention,sliding_attention,full_attention]"],
    "26b_a4b": ["model.hf_config.num_hidden_layers=6",
                "model.hf_config.layer_types=[sliding_attention,sliding_attention,sliding_attention,"
                "sliding_attention,sliding_attention,full_attention]"],
    "31b": ["model.hf_config.num_hidden_layers=6",
            "model.hf_config.layer_types=[sliding_attention,sliding_attention,sliding_attention,"
            "sliding_attention,sliding_attention,full_attention]"],
}


# The interpreter's tl.dot is np.matmul, and OpenBLAS may sum a row's products in an order that depends on
# where the row sits in the block (its Haswell kernels do: a row moved by one gives other bits), which a
# GPU's MMA does not; the invariance tests move a query's rows about a tile. Here each output element
# sums its K products in order, wherever its row is (operands as the interpreter converts them).
INTERPRETER_DOT = """
import numpy as _np
import triton.runtime.interpreter as _interp
_matmul_dot = _interp.InterpreterBuilder.create_dot
def _row_invariant_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
        return _matmul_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    acc = d.data.dtype
    products = a.data.astype(acc)[..., :, :, None] * b.data.astype(acc)[..., None, :, :]
    total = _np.zeros_like(products[..., 0, :])
    for k in range(products.shape[-2]):
        total += products[..., k, :]
    return _interp.TensorHandle(total + d.data, d.dtype.scalar)
_interp.InterpreterBuilder.create_dot = _row_invariant_dot
"""


def run_interpreted(code: str) -> str:
    """`code` in a fresh Python with TRITON_INTERPRET=1 (the variable must be set before Triton
    loads): Triton kernels on the CPU, their dot products row-invariant (INTERPRETER_DOT). Returns its
    stdout; a failure shows its stderr."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", INTERPRETER_DOT + textwrap.dedent(code)], capture_output=True,
                       text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def make_engine(*overrides: str, model: str = "tiny"):
    return build_engine(compose([f"+model={model}", *SMALL, *overrides]))


def gpu_engine(*overrides: str):
    """An engine on the GPU with a small pool and batch (the GPU tests)."""
    return build_engine(compose(["device=cuda", "kv.max_pages=128", "engine.max_model_len=1024",
                                 "engine.max_batch_size=8", *overrides]))


def random_prompts(vocab: int, lengths=(7, 130, 600), seed: int = 0) -> list[list[int]]:
    """Prompts of random token ids (after BOS) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [[2] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in lengths]


def outputs_per_setting(build, key: str, values, prompts, params) -> list:
    """generate(prompts, params) on an engine built by build(f"{key}={v}") for each of `values`: one
    config each, the same model seed (the same weights)."""
    text = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
    return [build(f"{key}={text(v)}").generate(prompts, params) for v in values]


def tiny_multimodal(seed: int):
    """A multimodal Gemma4ForConditionalGeneration around the tiny text config (a small vision tower,
    no audio): what a user's checkpoint directory holds, in miniature."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(compose(["+model=tiny"]).model.hf_config)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    torch.manual_seed(seed)
    return Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision, audio_config=None))


@pytest.fixture(scope="session")
def tiny_engine():
    return make_engine()


@pytest.fixture(scope="session")
def tiny_moe_engine():
    return make_engine(model="tiny_moe")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def isolated_wandb(tmp_path_factory):
    """W&B never reaches the network or ~/.config in tests: runs are offline (the logger group) and
    wandb's own settings, cache and data live in a temporary directory, for subprocesses too."""
    import os

    home = tmp_path_factory.mktemp("wandb_home")
    keep = {k: os.environ.get(k) for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR",
                                            "WANDB_ARTIFACT_DIR", "WANDB_MODE", "WANDB_API_KEY", "WANDB_SILENT")}
    for k in ("WANDB_MODE", "WANDB_API_KEY"):
        os.environ.pop(k, None)
    os.environ.update(WANDB_CONFIG_DIR=str(home / "config"), WANDB_CACHE_DIR=str(home / "cache"),
                      WANDB_DATA_DIR=str(home / "data"), WANDB_ARTIFACT_DIR=str(home / "artifacts"),
                      WANDB_SILENT="true")
    yield
    for k, v in keep.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# -- shared by the tests of several folders: a checkpoint with a tokenizer (workload, hostile input), a
# Hydra app on flexgemma's launcher (sweeps, hostile input), jobs written by hand (the report)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start> {{ m['role'] }} {{ m['content'] }} <end> {% endfor %}"
                 "{% if add_generation_prompt %}<start> model {% endif %}")


@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tmp_path_factory):
    """A tiny Gemma-4 checkpoint (random weights) with a word-level tokenizer and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import Gemma4ForCausalLM, PreTrainedTokenizerFast

    from flexgemma.model.load import text_config_from_dict

    path = tmp_path_factory.mktemp("ckpt_tok")
    hf = dict(compose(["+model=tiny"]).model.hf_config)
    torch.manual_seed(7)
    Gemma4ForCausalLM(text_config_from_dict(hf)).save_pretrained(path)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start>", "<end>"]
    words = specials + ["user", "model", "hello", "world", "the", "cat", "sat", "on", "mat"]
    words += [f"w{i}" for i in range(hf["vocab_size"] - len(words))]  # every id decodes to a word
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def run_python(args, cwd, timeout=500):
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)


APP = """
import os, hydra

@hydra.main(config_path=".", config_name="app", version_base="1.3")
def app(cfg):
    if cfg.x == 2:
        os._exit(7)  # the process dies, as under the OOM killer or a segfault
    if cfg.x == 3:
        raise RuntimeError("boom")
    return float(cfg.x)

if __name__ == "__main__":
    app()
"""

APP_CONFIG = """
defaults:
  - override hydra/launcher: flexgemma_local
  - _self_
x: 0
task:
  objective: value
"""


BASE = ["+model=tiny", "workload.num_prompts=16"]


def cpu_summary(total: float, **extra) -> dict:
    """A CPU bench job's summary.json, shaped like run.py writes it."""
    s = {
        "bench/generated_tokens_per_round": 512, "bench/round_seconds_median": 512 / total, "bench/rounds": 3,
        "build/seconds": 1.56,
        "choices": {"attn": "default", "cudagraph": "ladder8", "kv": "default", "logger": "none", "lora": "none",
                    "quant": "bf16", "task": "bench", "workload": "synthetic"},
        "determinism/run_to_run": True, "engine/attention_backend": "dense", "engine/device": "cpu",
        "engine/kv_pages": 128, "env/gpu": "none", "env/torch": "2.13.0+cpu",
        "latency/tpot_p50_ms": 10.49, "latency/tpot_p99_ms": 10.63, "latency/ttft_p50_ms": 44.4,
        "latency/ttft_p99_ms": 45.6, "memory/kv_pool_gib": 0.0098, "memory/peak_rss_gib": 0.377,
        "memory/weights_gib": 0.0023, "model": "tiny",
        "samples": [{"prompt_tokens": 12, "completion_ids": [5, 6, 7]}], "status": "ok", "task": "bench",
        "throughput/decode_tok_s_median": total * 1.1, "throughput/decode_tok_s_best": total * 1.122,
        "throughput/prefill_tok_s_median": 10001.0, "throughput/output_tok_s_median": total,
        "throughput/output_tok_s_best": total * 1.02, "workload/prompts": 16,
    }
    s.update(extra)
    return s


def write_job(job_dir: Path, overrides: list[str], summary: dict | None, rounds: list[float] = (),
              config: dict | None = None) -> Path:
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job_dir / "config_resolved.yaml").write_text(yaml.safe_dump(config or {"seed": 0, "device": "auto"}))
    with open(job_dir / "metrics.jsonl", "w") as f:
        for r, total in enumerate(rounds):
            f.write(json.dumps({"round": r, "throughput/output_tok_s": total, "throughput/decode_tok_s": total * 1.1,
                                "throughput/prefill_tok_s": 10000.0 + r, "bench/round_seconds": 512 / total}) + "\n")
    if summary is not None:
        (job_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return job_dir
