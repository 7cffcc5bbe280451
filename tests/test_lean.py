"""A bf16 build imports no bitsandbytes (its OpenMP pool busy-waits against torch's on the CPU), and
`python -m flexgemma` sets the OpenMP wait policy before torch is imported."""

import json
import os
import subprocess
import sys

from conftest import ROOT  # noqa: E402 - the repository


def _python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=full_env,
                          cwd=ROOT)


def test_bf16_build_does_not_import_bitsandbytes():
    r = _python(
        "import sys, json\n"
        "from flexgemma import compose, build_engine\n"
        "from flexgemma.tasks.common import memory_metrics\n"
        "from flexgemma.run.tracking import environment\n"
        "e = build_engine(compose(['+model=tiny']))\n"
        "memory_metrics(e); env = environment()\n"
        "print(json.dumps({'bnb': 'bitsandbytes' in sys.modules, 'env': env}))\n")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bnb"] is False
    env = out["env"]
    assert env["env/threads"] >= 1 and env["env/cpu"] and env["env/peft"] != "none"
    assert "env/bitsandbytes" in env


def test_package_import_is_light():
    """`import flexgemma` (what `python -m flexgemma` runs first) imports no torch: the CLI sets
    OMP_WAIT_POLICY before torch reads it."""
    r = _python("import sys, flexgemma\nprint('torch' in sys.modules)\n"
                "from flexgemma import SamplingParams, compose\nprint(callable(compose), SamplingParams.__name__)")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["False", "True", "SamplingParams"]


def test_cli_sets_omp_wait_policy_unless_set():
    code = ("import runpy, sys, os\nsys.argv = ['flexgemma', '--help']\n"
            "try:\n    runpy.run_module('flexgemma', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('POLICY', os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "POLICY PASSIVE" in r.stdout
    r = _python(code, {"OMP_WAIT_POLICY": "ACTIVE"})
    assert "POLICY ACTIVE" in r.stdout


import pytest  # noqa: E402


@pytest.mark.parametrize("async_decode", [True, False])
def test_tokens_generated_counts_every_generated_token(async_decode):
    from conftest import make_engine

    from flexgemma import SamplingParams
    from flexgemma.tasks.common import token_progress

    engine = make_engine(f"engine.async_decode={str(async_decode).lower()}")
    before = engine.tokens_generated
    params = SamplingParams(max_new_tokens=7, temperature=1.0, seed=3, ignore_eos=True)
    with token_progress(engine, "test", total=3 * 7, interval=0.01, disable=False) as bar:
        outs = engine.generate([[2, 18, 279], [2, 51], [2, 17, 99, 301]], params)
    generated = sum(len(o.token_ids) for o in outs)
    assert generated == 21 and engine.tokens_generated - before == generated
    assert bar.n == generated
