"""The comparison report (`python -m flexgemma.report`) over fake sweeps and over real tiny jobs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from flexgemma.report import ReportError, build_report
from flexgemma.report.__main__ import main as report_main
from flexgemma.report.collect import collect, parse_override
from flexgemma.report.tables import short_keys

from conftest import BASE, ROOT, cpu_summary, write_job

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
       "HYDRA_FULL_ERROR": "1"}
# what a GPU job records about its build: flex attention (reads attn.decode.*), CUDA graphs captured
GPU_FACTS = {"engine/attention_backend": "flex", "engine/cudagraphs": True, "engine/device": "cuda"}


def fake_sweep(root: Path) -> Path:
    """A Hydra multirun dir of GPU jobs: attn.decode.block_n x cudagraph (2x2) plus one failed job.
    (block_n=32, ladder16) is the fastest."""
    speeds = {("16", "ladder8"): 1100.0, ("16", "ladder16"): 1250.0, ("32", "ladder8"): 1300.0,
              ("32", "ladder16"): 1500.0}
    n = 0
    for (block_n, ladder), total in speeds.items():
        ov = [*BASE, f"attn.decode.block_n={block_n}", f"cudagraph={ladder}"]
        roofline = {"bandwidth/decode_gb_s_median": total * 1.1, "bandwidth/decode_pct_of_peak_median": total * 1.1 / 48}
        write_job(root / f"{n}_{','.join(ov[2:])}", ov, cpu_summary(total, **GPU_FACTS, **roofline),
                  rounds=[total * 0.97, total, total * 1.02])
        n += 1
    ov = [*BASE, "attn.decode.block_n=64", "cudagraph=ladder8"]
    write_job(root / f"{n}_{','.join(ov[2:])}", ov,
              {"status": "failed", "model": "tiny", "task": "bench",
               "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
               "traceback": "Traceback (most recent call last):\n  ...\nOutOfMemoryError: CUDA out of memory."})
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def assert_valid_png(path: Path):
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 150


def test_report_of_a_sweep(tmp_path):
    sweep = fake_sweep(tmp_path / "sweep")
    report = build_report([sweep])
    coll = report.collection
    assert coll.swept_keys == ["attn.decode.block_n", "cudagraph"]  # the shared overrides are not swept
    best = coll.best()
    assert best.swept == {"attn.decode.block_n": "32", "cudagraph": "ladder16"}
    assert report.verdict.command == ("python -m flexgemma +model=tiny workload.num_prompts=16 "
                                      "attn.decode.block_n=32 cudagraph=ladder16")

    md = (sweep / "report.md").read_text()
    assert md.startswith("# ") and "Best: block_n=32, cudagraph=ladder16 (job 3)" in md.splitlines()[2]
    assert "| **1** | **3** | **32** | **ladder16** | **ok** | **1,500** | **1,455 – 1,530 (3)** |" in md
    assert "| **1,650 (34%)** |" in md and "| 1,210 (25%) |" in md  # decode GB/s and the roofline's share
    assert "OutOfMemoryError: CUDA out of memory" in md and "| 4 | 64 | ladder8 | failed |" in md
    assert "peak RSS GiB" in md  # CPU jobs: no GPU memory keys, and no crash for their absence

    html = (sweep / "report.html").read_text()
    assert re.search(r'<tr class="status-ok best"><td class="num">1</td><td>3</td>', html)
    assert "status-failed" in html and "OutOfMemoryError" in html
    assert html.count("data:image/png;base64,") == len(report.plots) >= 5
    assert not re.search(r'src="(?!data:)', html)  # self-contained: no external assets
    names = {p.path.name for p in report.plots}
    assert {"throughput_vs_attn_decode_block_n.png", "throughput_vs_cudagraph.png", "throughput_rounds.png",
            "memory.png", "determinism.png"} <= names
    for plot in report.plots:
        assert plot.path.parent == sweep and f"]({plot.path.name})" in md
        assert_valid_png(plot.path)


def test_cli_writes_into_out(tmp_path):
    sweep = fake_sweep(tmp_path / "sweep")
    r = subprocess.run([sys.executable, "-m", "flexgemma.report", str(sweep), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Best: block_n=32, cudagraph=ladder16" in r.stdout
    assert {"report.md", "report.html", "memory.png"} <= {p.name for p in (tmp_path / "out").iterdir()}
    assert not (sweep / "report.md").exists()
    (tmp_path / "out" / "throughput_vs_gone.png").write_bytes(b"stale")  # from an earlier report
    build_report([sweep], out=tmp_path / "out")
    assert not (tmp_path / "out" / "throughput_vs_gone.png").exists()


def test_cli_clear_errors(tmp_path, capsys):
    assert report_main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    with pytest.raises(ReportError, match="no jobs found"):
        build_report([tmp_path])


def test_zero_ok_jobs_are_reported_not_crashed(tmp_path):
    root = tmp_path / "sweep"
    write_job(root / "0_kv.page_size=48", ["kv.page_size=48"],
              {"status": "invalid", "error": "kv.page_size=48: must be a power of two"})
    write_job(root / "1_kv.page_size=64", ["kv.page_size=64"], {"status": "failed", "traceback": "boom\nValueError: x"})
    write_job(root / "2_kv.page_size=128", ["kv.page_size=128"], None)  # killed: no summary.json
    report = build_report([root])
    assert report.verdict.command is None
    md = report.markdown.read_text()
    assert "No best configuration: 3 job(s), none finished with status ok (1 failed, 1 invalid, 1 incomplete)" in md
    assert "must be a power of two" in md and "ValueError: x" in md and "no summary.json" in md
    assert report.plots == [] and "No plots: no job recorded" in md


def test_single_runs_without_hydra_records_are_diffed_by_config(tmp_path):
    """Run dirs without .hydra: swept keys come from config_resolved.yaml (a nested key and a
    non-numeric value), and a GPU run beside a CPU run shows which peak memory is which."""
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    for d, block_n, backend, summary in [
        (a, 16, "flex", cpu_summary(900.0)),
        (b, 32, "dense", cpu_summary(1000.0, **{"memory/peak_allocated_gib": 12.5, "memory/peak_rss_gib": None,
                                                "determinism/run_to_run": False, "parity/token_match_pct": 99.2})),
    ]:
        d.mkdir()
        (d / "summary.json").write_text(json.dumps(summary))
        (d / "config_resolved.yaml").write_text(yaml.safe_dump(
            {"seed": 0, "attn": {"backend": backend, "decode": {"block_n": block_n, "block_m": None}}}))
    report = build_report([a, b], out=tmp_path / "out")
    assert report.collection.swept_keys == ["attn.backend", "attn.decode.block_n"]
    assert report.collection.swept_from == "config"
    assert report.collection.best().dir == b
    md = report.markdown.read_text()
    assert "12.5 (allocated)" in md and "0.377 (RSS)" in md and "99.2" in md
    assert "python -m flexgemma attn.backend=dense attn.decode.block_n=32" in md
    assert "not deterministic" in md


def test_a_single_run(tmp_path):
    run = write_job(tmp_path / "run", ["+model=tiny"], cpu_summary(1234.0), rounds=[1200.0, 1234.0, 1250.0])
    report = build_report([run])
    assert report.collection.swept_keys == []
    assert "Only one job finished ok" in report.markdown.read_text()
    assert "throughput_rounds.png" in {p.path.name for p in report.plots}


def test_rerun_job_uses_its_last_attempt_of_rounds(tmp_path):
    job = write_job(tmp_path / "run", [], cpu_summary(500.0), rounds=[100.0, 110.0])
    with open(job / "metrics.jsonl", "a") as f:  # a second attempt appends to metrics.jsonl
        for r, v in enumerate([490.0, 500.0, 510.0]):
            f.write(json.dumps({"round": r, "throughput/output_tok_s": v}) + "\n")
        f.write('{"round": 3, "throughput/tot')  # cut short by a kill
    (j,) = collect([job]).jobs
    assert j.round_values("throughput/output_tok_s") == [490.0, 500.0, 510.0]


def test_override_parsing_and_short_keys():
    assert parse_override("+attn.decode.block_n=32") == ("attn.decode.block_n", "32")
    assert parse_override("++kv.max_pages=64") == ("kv.max_pages", "64")
    assert parse_override("~lora") == ("lora", "(deleted)")
    assert parse_override("workload.path=/a=b.jsonl") == ("workload.path", "/a=b.jsonl")
    assert short_keys(["attn.decode.block_n", "cudagraph"]) == {"attn.decode.block_n": "block_n",
                                                                "cudagraph": "cudagraph"}
    assert short_keys(["attn.decode.block_n", "attn.prefill.block_n"]) == {
        "attn.decode.block_n": "decode.block_n", "attn.prefill.block_n": "prefill.block_n"}


def test_wandb_report_fails_clearly_without_the_package(tmp_path, monkeypatch):
    from flexgemma.report.wandb_report import WandbReportError, publish_wandb_report

    report = build_report([write_job(tmp_path / "run", ["+model=tiny"], cpu_summary(1234.0))])
    monkeypatch.setitem(sys.modules, "wandb_workspaces", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "wandb_workspaces.reports", None)
    monkeypatch.setitem(sys.modules, "wandb_workspaces.reports.v2", None)
    with pytest.raises(WandbReportError, match="pip install wandb-workspaces"):
        publish_wandb_report(report, "me/flexgemma")


@pytest.mark.slow
def test_end_to_end_two_tiny_jobs(tmp_path):
    """Two real jobs through the CLI's multirun, then the report over their sweep dir (in-process:
    test_cli_writes_into_out already runs the report's CLI)."""
    sweep = tmp_path / "multirun"
    r = subprocess.run([sys.executable, "-m", "flexgemma", "-m", f"hydra.sweep.dir={sweep}",
                        "workload.num_prompts=2", "workload.max_new_tokens=4", "workload.rounds=1",
                        "workload.warmup_rounds=0", "attn.q_block_size=64,128"],
                       cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert report_main([str(sweep)]) == 0
    md = (sweep / "report.md").read_text()
    assert "Swept keys: `attn.q_block_size`" in md and "2 ok" in md
    assert "attn.q_block_size=" in md.split("```bash")[1]
    assert "data:image/png;base64" in (sweep / "report.html").read_text()
    assert_valid_png(sweep / "throughput_vs_attn_q_block_size.png")
