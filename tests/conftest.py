import os

# bitsandbytes' CPU kernels and torch each keep an OpenMP pool; with busy-waiting workers they
# starve each other on few cores (a 4-bit matmul ~300x slower). Set before torch starts its pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from flexgemma import build_engine, compose

# Small pages and window-sized prompts so every test crosses pages and the sliding window.
SMALL = ["kv.page_size=8", "kv.cpu_pages=80", "engine.max_model_len=256", "device=cpu"]


def run_interpreted(code: str) -> str:
    """`code` in a fresh Python with TRITON_INTERPRET=1 (the variable must be set before Triton
    loads): Triton kernels on the CPU. Returns its stdout; a failure shows its stderr."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def make_engine(*overrides: str, model: str = "tiny"):
    return build_engine(compose([f"+model={model}", *SMALL, *overrides]))


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
