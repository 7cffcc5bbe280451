"""The report's verdict numbers on fixtures built to overlap and not to overlap, and markup in
errors and swept values escaped in report.html (plots survive `$...$` values)."""

import re

import pytest

from flexgemma.report import build_report

from test_report import assert_valid_png, fake_sweep

from conftest import BASE, cpu_summary, write_job

# the note every verdict over jobs without a repeat axis ends with (report/noise.py)
NO_REPEATS = (" No configuration ran more than once, so the job-to-job noise is unknown: add a repeat axis (+repeat=0,1,2) to measure it.")


def two_jobs(root, best_rounds, runner_rounds):
    """Two ok jobs swept over cudagraph: ladder16 at median(best_rounds), ladder8 at median(runner_rounds)."""
    for n, (ladder, rounds) in enumerate([("ladder8", runner_rounds), ("ladder16", best_rounds)]):
        ov = [*BASE, f"cudagraph={ladder}"]
        total = sorted(rounds)[len(rounds) // 2]
        write_job(root / f"{n}_{ladder}", ov, cpu_summary(total), rounds=rounds)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def test_separated_runner_up_gap_and_ratio_to_the_slowest(tmp_path):
    # fake_sweep: best 1500 (rounds 1455-1530), runner-up 1300 (1261-1326), slowest 1100
    report = build_report([fake_sweep(tmp_path / "sweep")])
    v = report.verdict
    assert ", 1.36× the slowest (1,100)" in v.headline  # 1500 / 1100
    assert v.notes[0] == "Runner-up: block_n=32, cudagraph=ladder8 (job 2), 13.3% slower." + NO_REPEATS  # (1500-1300)/1500
    assert "overlap" not in (tmp_path / "sweep" / "report.md").read_text()


def test_overlapping_rounds_say_the_order_may_be_noise(tmp_path):
    sweep = two_jobs(tmp_path / "sweep", best_rounds=[950.0, 1000.0, 1020.0], runner_rounds=[960.0, 980.0, 990.0])
    v = build_report([sweep]).verdict
    assert ", 1.02× the slowest (980)" in v.headline
    assert v.notes[0].startswith("Runner-up: cudagraph=ladder8 (job 0), 2.0% slower. Their round-to-round "
                                 "ranges overlap, so the order may be noise")
    assert "may be noise" in (sweep / "report.md").read_text() and "may be noise" in (sweep / "report.html").read_text()


def test_touching_but_separate_rounds_are_not_called_noise(tmp_path):
    sweep = two_jobs(tmp_path / "sweep", best_rounds=[991.0, 1000.0, 1010.0], runner_rounds=[960.0, 980.0, 990.0])
    v = build_report([sweep]).verdict
    assert v.notes[0] == "Runner-up: cudagraph=ladder8 (job 0), 2.0% slower." + NO_REPEATS


def test_markup_in_errors_and_swept_values_is_escaped(tmp_path):
    root = tmp_path / "sweep"
    evil = "<script>alert(1)</script> & $x$"
    for n, (value, total) in enumerate([("$x$", 1000.0), ("a<b>&c", 1200.0)]):
        ov = [*BASE, f"workload.name={value}"]
        write_job(root / f"{n}_job", ov, cpu_summary(total), rounds=[total * 0.99, total, total * 1.01])
    ov = [*BASE, "workload.name=<i>bad</i>"]
    write_job(root / "2_job", ov, {"status": "failed", "model": "tiny", "task": "bench", "error": evil,
                                   "traceback": f"Traceback:\n  {evil}"})
    (root / "multirun.yaml").write_text("hydra: {}\n")
    report = build_report([root])
    page = (root / "report.html").read_text()
    assert "<script>" not in page and "<b>&c" not in page and "<i>bad</i>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; $x$" in page
    assert "a&lt;b&gt;&amp;c" in page and "&lt;i&gt;bad&lt;/i&gt;" in page
    assert not re.search(r"&(?!(amp|lt|gt|quot|#x27|#\d+|[a-z]+);)", page)  # every & is an entity
    assert report.plots, "the plots were not made"
    for plot in report.plots:
        assert_valid_png(plot.path)


def test_plots_survive_values_that_are_not_valid_mathtext(tmp_path):
    root = tmp_path / "sweep"
    for n, (value, total) in enumerate([("$x^$", 1000.0), (r"$\frac{$", 1100.0), ("plain", 1200.0)]):
        write_job(root / f"{n}_job", [*BASE, f"workload.name={value}"], cpu_summary(total),
                  rounds=[total * 0.99, total, total * 1.01])
    (root / "multirun.yaml").write_text("hydra: {}\n")
    report = build_report([root])
    assert "$x^$" in (root / "report.html").read_text()
    for plot in report.plots:
        assert_valid_png(plot.path)
