"""The GPU benchmark script runs end to end on the CPU (a smoke test: device time is scarce, a
script that crashes there wastes it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_vs_hf_smoke(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "bench_vs_hf.py"), "+model=tiny", "workload.num_prompts=3",
         "workload.max_new_tokens=6", "workload.rounds=1", "workload.warmup_rounds=0", "logger=none",
         "--hf-rounds", "1", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["flexgemma/tok_s_median"] > 0 and res["hf/tok_s_median"] > 0
    assert res["hf/generated_tokens"] == 3 * 6
    assert res["roofline/weight_gb_per_step"] > 0
