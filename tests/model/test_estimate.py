"""Big models on small machines: refused before building, in one line, with the estimate and the
CPU-sized variant of the same architecture (model/estimate.py)."""

import os
import subprocess
import sys
import time

import pytest
import torch

from flexgemma import build_engine, compose
from flexgemma.config.schema import ConfigError
from flexgemma.model.estimate import estimate_build, refuse_if_too_large


def test_cli_26b_a4b_bnb4_on_cpu_answers_at_once_with_the_estimate_and_tiny_moe(tmp_path):
    from conftest import ROOT as root

    env = {**os.environ, "PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": ""}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "flexgemma", "+model=26b_a4b", "quant=bnb4", "logger=none",
                        f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env=env)
    took = time.perf_counter() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "'26b_a4b': 25.23B parameters (bnb4) need ~14.2 GiB of weights" in out
    assert "too large for a CPU" in out and "+model=tiny_moe" in out and "model.allow_large_cpu=true" in out
    assert took < 60, f"{took:.0f} s: the model was being built instead of refused"  # a guard, not a benchmark


def test_dense_variant_on_cpu_points_to_tiny():
    with pytest.raises(ConfigError, match=r"'e2b': .*too large for a CPU.*\+model=tiny \(the same dense") as e:
        build_engine(compose(["+model=e2b", "device=cpu"]))
    assert "quant=bnb4" not in str(e.value)  # the CPU limit counts parameters: 4-bit would be refused as well


def test_too_little_memory_offers_4bit_weights():
    cfg = compose(["+model=e2b"])
    est = estimate_build(cfg.model, cfg.quant, torch.device("cuda"))
    with pytest.raises(ConfigError, match=r"more than the 4\.0 GiB free on cuda.*quant=bnb4"):
        refuse_if_too_large(est, 0, torch.device("cuda"), 4 << 30)


def test_estimate_counts_parameters_and_4bit_bytes():
    from transformers import Gemma4ForCausalLM

    from flexgemma.model.load import text_config_from_dict

    cfg = compose(["+model=tiny_moe"])
    with torch.device("meta"):
        m = Gemma4ForCausalLM(text_config_from_dict(cfg.model.hf_config))
    total = sum(p.numel() for p in m.parameters())
    plain = estimate_build(cfg.model, cfg.quant, torch.device("cpu"))
    assert plain.params == total and plain.weight_bytes == 4 * total and plain.moe and not plain.quantised
    q = estimate_build(cfg.model, compose(["+model=tiny_moe", "quant=bnb4"]).quant, torch.device("cpu"))
    assert q.params == total and q.quantised and q.weight_bytes < 0.45 * 2 * total


def test_gpu_with_too_little_free_memory_is_refused_and_enough_is_not():
    cfg = compose(["+model=26b_a4b", "quant=bnb4"])
    cuda = torch.device("cuda")
    est = estimate_build(cfg.model, cfg.quant, cuda)
    with pytest.raises(ConfigError, match=r"more than the 8\.0 GiB free on cuda.*tiny_moe"):
        refuse_if_too_large(est, 0, cuda, 8 << 30)
    refuse_if_too_large(est, 1 << 30, cuda, 140 << 30)  # an H200: builds


def test_tiny_and_the_default_build_without_the_flag():
    assert build_engine(compose(["+model=tiny", "device=cpu", "kv.cpu_pages=16"])).info["name"] == "tiny"
    assert build_engine(compose(["device=cpu", "kv.cpu_pages=16"])).info["name"] == "tiny"
