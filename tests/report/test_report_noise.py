"""The report's verdict against what cannot explain a difference: swept keys the runs never read
(inert) and job-to-job noise measured by repeated jobs; and its CSV / parquet export."""

import csv
import shutil
import sys

import pytest
import yaml

from flexgemma import compose
from flexgemma.report import build_report
from flexgemma.report.collect import collect
from flexgemma.report.noise import inert_keys
from flexgemma.run.job import run_job
from test_report import GPU_FACTS

from conftest import BASE, cpu_summary, write_job

CPU_FACTS = {"engine/attention_backend": "dense", "engine/cudagraphs": False, "engine/device": "cpu"}


def sweep(root, points: list[tuple[list[str], float, dict]]):
    """A sweep dir: each point is (swept overrides, output tok/s median, recorded build facts)."""
    for n, (overrides, total, facts) in enumerate(points):
        ov = [*BASE, *overrides]
        write_job(root / f"{n}_{','.join(overrides)}", ov, cpu_summary(total, **facts),
                  rounds=[total * 0.99, total, total * 1.01])
    return root


def test_cpu_sweep_over_block_n_is_inert_and_crowns_nothing(tmp_path):
    """The issue's case: on the CPU the backend is dense, block_n is never read, and a 32x gap
    between jobs is not a reason to recommend a value."""
    root = sweep(tmp_path / "s", [(["attn.decode.block_n=16"], 30.0, CPU_FACTS),
                                  (["attn.decode.block_n=32"], 960.0, CPU_FACTS),
                                  (["attn.decode.block_n=64"], 900.0, CPU_FACTS)])
    report = build_report([root])
    assert inert_keys(report.collection) == {
        "attn.decode.block_n": "the attention backend was dense, which takes no flex kernel options"}
    v = report.verdict
    assert v.command is None and v.best is None
    assert v.headline.startswith("No best configuration: the jobs differ only in inert or repeat keys "
                                 "(attn.decode.block_n), so they ran one configuration: 900 output tok/s, "
                                 "the median of 3 job(s)")
    md = report.markdown.read_text()
    assert "`attn.decode.block_n` is inert: it has no effect in these runs (the attention backend was dense" in md
    assert "Best:" not in md and "**bold**" not in md and "Re-run the best" not in md


def test_inert_key_beside_a_live_one_names_only_the_live_one(tmp_path):
    """block_n (inert on the CPU) x lora (read): jobs equal in lora are repeats of one configuration."""
    points = [([f"attn.decode.block_n={b}", f"lora={lora}"], total, CPU_FACTS)
              for (b, lora), total in {(16, "none"): 1000.0, (32, "none"): 1010.0,
                                       (16, "r16"): 700.0, (32, "r16"): 705.0}.items()]
    report = build_report([sweep(tmp_path / "s", points)])
    v = report.verdict
    assert v.headline == ("Best: lora=none (jobs 1, 0) at 1,005 output tok/s (median of 2 repeated jobs' "
                          "medians), 1.43× the slowest (702); 4 ok.")
    assert v.best.name == "1"
    assert any(n.startswith("Runner-up: lora=r16 (jobs 3, 2), 30.1% slower. That is more than the 1.0% "
                            "spread between repeated jobs (4 jobs).") for n in v.notes)
    assert v.command.endswith("attn.decode.block_n=32 lora=none")


def test_difference_within_the_spread_of_repeats_is_within_noise(tmp_path):
    """Two live configurations, three repeats each (+repeat=N): a 2% gap against a 10% spread."""
    totals = {("flex", 0): 1000.0, ("flex", 1): 1100.0, ("flex", 2): 1050.0,
              ("dense", 0): 1020.0, ("dense", 1): 990.0, ("dense", 2): 1030.0}
    points = [([f"attn.backend={b}", f"+repeat={r}"], t, GPU_FACTS | {"engine/attention_backend": b})
              for (b, r), t in totals.items()]
    report = build_report([sweep(tmp_path / "s", points)])
    v = report.verdict
    assert report.collection.swept_keys == ["attn.backend", "repeat"]
    assert v.command is None and v.best is None
    assert v.headline == ("Within noise: the fastest configuration, backend=flex (1,050 output tok/s), is 2.9% "
                          "ahead of backend=dense (1,020), no more than the 9.5% spread between repeated jobs "
                          "(6 jobs); 6 ok.")
    assert "**bold**" not in report.markdown.read_text()


def test_difference_beyond_the_spread_of_repeats_is_a_verdict(tmp_path):
    totals = {("flex", 0): 1500.0, ("flex", 1): 1510.0, ("dense", 0): 1000.0, ("dense", 1): 1040.0}
    points = [([f"attn.backend={b}", f"seed={r}"], t, GPU_FACTS | {"engine/attention_backend": b})
              for (b, r), t in totals.items()]
    report = build_report([sweep(tmp_path / "s", points)])
    v = report.verdict
    assert v.headline.startswith("Best: backend=flex (jobs 1, 0) at 1,505 output tok/s")
    assert "Runner-up: backend=dense (jobs 3, 2), 32.2% slower. That is more than the 3.9% spread between " \
           "repeated jobs (4 jobs)." in v.notes
    assert v.command == "python -m flexgemma +model=tiny workload.num_prompts=16 attn.backend=flex seed=1"
    md = report.markdown.read_text()
    assert "| **1** | **1** | **flex** | **1** | **ok** | **1,510** |" in md  # the crowned job in bold


def test_a_key_read_by_some_jobs_is_not_inert(tmp_path):
    """block_n is read by the flex jobs: not inert, though the dense jobs ignore it."""
    points = [(["attn.decode.block_n=16"], 900.0, CPU_FACTS), (["attn.decode.block_n=32"], 1000.0, GPU_FACTS)]
    coll = collect([sweep(tmp_path / "s", points)])
    assert inert_keys(coll) == {}
    # cudagraph on the CPU (no graphs captured), kernels.moe on a dense model and the prefill masks'
    # full blocks under the dense backend are inert; the fused K/V write is read by every backend
    points = [([f"cudagraph={c}", f"kernels.moe={k}", f"kernels.prefill_full_blocks={f}", f"kernels.fused_kv_write={f}"],
               900.0 + i, CPU_FACTS)
              for i, (c, k, f) in enumerate([("ladder8", "triton", "true"), ("ladder16", "grouped_mm", "false")])]
    coll = collect([sweep(tmp_path / "t", points)])
    assert inert_keys(coll) == {"cudagraph": "no CUDA graphs were captured (a CPU run, or cudagraph=off)",
                                "kernels.moe": "the model has no MoE layers",
                                "kernels.prefill_full_blocks": "the attention backend was dense, which evaluates "
                                                               "the mask on every listed page"}


def test_csv_and_parquet_beside_the_report(tmp_path):
    points = [(["attn.decode.block_n=16"], 1100.0, GPU_FACTS), (["attn.decode.block_n=32"], 1500.0, GPU_FACTS)]
    root = sweep(tmp_path / "s", points)
    write_job(root / "2_attn.decode.block_n=64", [*BASE, "attn.decode.block_n=64"],
              {"status": "failed", "error": "OutOfMemoryError: CUDA out of memory", "traceback": "a\nb"})
    report = build_report([root])
    with open(root / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"], r["attn.decode.block_n"], r["throughput/output_tok_s_median"]) for r in rows] == [
        ("0", "ok", "16", "1100.0"), ("1", "ok", "32", "1500.0"), ("2", "failed", "64", "")]
    assert rows[2]["error"] == "OutOfMemoryError: CUDA out of memory"
    assert "traceback" not in rows[0] and "samples" not in rows[0] and "choices" not in rows[0]
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    assert report.exports == [root / "report.csv", root / "report.parquet"]
    df = pd.read_parquet(root / "report.parquet")
    assert df["throughput/output_tok_s_median"].tolist()[:2] == [1100.0, 1500.0]
    assert df["job"].tolist() == ["0", "1", "2"]


def test_without_pandas_only_the_csv(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if not installed
    root = sweep(tmp_path / "s", [([], 1000.0, GPU_FACTS)])
    report = build_report([root])
    assert report.exports == [root / "report.csv"] and not (root / "report.parquet").exists()


@pytest.mark.slow
def test_a_real_cpu_job_records_what_makes_block_n_inert(tmp_path):
    """One real tiny CPU job, its directory copied as the points of a block_n sweep: the facts the
    job itself recorded (dense attention, no CUDA graphs) make block_n and cudagraph inert."""
    overrides = ["+model=tiny", "device=cpu", "logger=none", "workload.num_prompts=2", "workload.max_new_tokens=4",
                 "workload.rounds=1", "workload.warmup_rounds=0"]
    job = tmp_path / "s" / "0"
    summary = run_job(compose(overrides), job)
    assert summary["status"] == "ok" and summary["engine/attention_backend"] == "dense"
    for n, (block_n, ladder) in enumerate([(16, "ladder8"), (32, "ladder16")]):
        d = tmp_path / "s" / str(n)
        if n:
            shutil.copytree(job, d)
        (d / ".hydra").mkdir(exist_ok=True)
        (d / ".hydra" / "overrides.yaml").write_text(
            yaml.safe_dump([*overrides, f"attn.decode.block_n={block_n}", f"cudagraph={ladder}"]))
    report = build_report([tmp_path / "s"])
    assert set(inert_keys(report.collection)) == {"attn.decode.block_n", "cudagraph"}
    assert report.verdict.command is None
    assert report.verdict.headline.startswith("No best configuration: the jobs differ only in inert or repeat keys")
