import os

# bitsandbytes' CPU kernels and torch each keep an OpenMP pool; with busy-waiting workers they
# starve each other on few cores (a 4-bit matmul ~300x slower). Set before torch starts its pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from flexgemma import build_engine, compose

# Small pages and window-sized prompts so every test crosses pages and the sliding window.
SMALL = ["kv.page_size=8", "kv.cpu_pages=80", "engine.max_model_len=256", "device=cpu"]


def make_engine(*overrides: str, model: str = "tiny"):
    return build_engine(compose([f"+model={model}", *SMALL, *overrides]))


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
