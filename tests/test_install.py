"""The core install works without the extras, and a feature whose extra is missing names it.

Each test runs a fresh interpreter (`python -S`) on a copy of this environment's site-packages made
of links to every package except the extras' (their metadata too), as after a plain
`pip install flexgemma`.
"""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"wandb", "bitsandbytes", "submitit", "hydra_submitit_launcher", "optuna", "hydra_optuna_sweeper",
          "matplotlib", "mpl_toolkits", "pandas", "pyarrow", "trl", "datasets"}


def _top(entry: str) -> str:
    return entry.split("-")[0].split(".")[0].lower()  # wandb-0.31.0.dist-info -> wandb


def lean_site(tmp_path: Path, blocked=EXTRAS) -> Path:
    """A site-packages of links to this one's entries, less the blocked packages and .pth files."""
    view = tmp_path / "lean-site"
    if view.is_dir():
        return view
    view.mkdir()
    for site in dict.fromkeys(Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")):
        for entry in site.iterdir():
            if entry.suffix == ".pth" or _top(entry.name) in blocked or (view / entry.name).exists():
                continue
            if entry.name == "hydra_plugins":  # a namespace package: keep only the plugins not blocked
                (view / entry.name).mkdir()
                for plugin in entry.iterdir():
                    if _top(plugin.name) not in blocked:
                        (view / entry.name / plugin.name).symlink_to(plugin)
            else:
                (view / entry.name).symlink_to(entry)
    return view


def run_lean(args: list[str], tmp_path: Path, blocked=EXTRAS, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(lean_site(tmp_path, blocked))])}
    return subprocess.run([sys.executable, "-S", *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tmp_path)


def run_blocked(body: str, tmp_path: Path, blocked=EXTRAS) -> subprocess.CompletedProcess:
    return run_lean(["-c", "import sys\n" + body], tmp_path, blocked)


def run_cli_blocked(args: list[str], tmp_path: Path, blocked=EXTRAS) -> subprocess.CompletedProcess:
    return run_lean(["-m", "flexgemma", *args], tmp_path, blocked)


SMALL = ["workload.num_prompts=2", "workload.max_new_tokens=4", "workload.rounds=1", "workload.warmup_rounds=0"]


def test_core_runs_the_default_job_without_any_extra(tmp_path):
    r = run_cli_blocked([f"hydra.run.dir={tmp_path}/run", *SMALL], tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["model"] == "tiny"
    assert summary["env/bitsandbytes"] == "none" and summary["env/threads"] >= 1
    # the default logger (W&B offline) without wandb: the job goes on and says which extra brings it
    assert 'pip install -e ".[wandb]"' in r.stderr + r.stdout
    assert "Error importing" not in r.stderr  # Hydra's plugin scan stays quiet without [slurm]


def test_core_import_path_imports_no_extra(tmp_path):
    r = run_blocked("import flexgemma\nfrom flexgemma import build_engine, compose, SamplingParams\n"
                    "import flexgemma.run.job, flexgemma.report.collect, flexgemma.config.extras\n"
                    "print('ok')", tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-4000:]


@pytest.mark.parametrize("args, extra", [
    (["quant=bnb4"], "bnb"),
    (["-m", "hydra/launcher=flexgemma_slurm", "seed=1,2"], "slurm"),
    (["-m", "+experiment=optuna_kernels", "model=tiny"], "optuna"),
    (["task=grpo"], "rl"),
])
def test_missing_extra_names_it(tmp_path, args, extra):
    run_dir = [] if "-m" in args else [f"hydra.run.dir={tmp_path}/run"]
    r = run_cli_blocked([*args, *run_dir, "logger=none", *SMALL], tmp_path)
    assert r.returncode != 0
    assert f'pip install -e ".[{extra}]"' in r.stderr + r.stdout, (r.stdout + r.stderr)[-4000:]


def test_report_without_matplotlib_names_the_extra(tmp_path):
    body = ("from flexgemma.report.__main__ import main\n"
            f"sys.exit(main([{str(tmp_path)!r}]))\n")
    r = run_blocked(body, tmp_path)
    assert r.returncode == 2
    assert 'pip install -e ".[report]"' in r.stderr, r.stderr[-4000:]


def test_a_sweep_without_submitit_runs_in_process_and_resumes(tmp_path):
    """Without the [slurm] extra the default launcher falls back to Hydra's basic launcher and says
    so; a second launch of the same sweep skips the jobs that finished."""
    sweep = ["-m", f"hydra.sweep.dir={tmp_path}/sweep", "logger=none", "seed=1,2", *SMALL]
    r = run_cli_blocked(sweep, tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "launcher basic (Hydra's)" in out and "submitit is not installed" in out
    for job in ("0", "1"):
        assert json.loads((tmp_path / "sweep" / job / "summary.json").read_text())["status"] == "ok"
    assert "sweep results:" in r.stdout
    again = run_cli_blocked(sweep, tmp_path)
    assert again.returncode == 0 and again.stdout.count("(finished before)") == 2, again.stdout[-4000:]


def test_no_torch_package_compiles_and_configs_compose(tmp_path):
    """What CI's newest-Python job runs (no torch wheel there): configs compose without torch."""
    body = ("from flexgemma import compose\n"
            "cfg = compose(['+model=e2b', '+experiment=speed_e2b'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print(cfg.model.name, cfg.workload.name)\n")
    r = run_blocked(body, tmp_path, blocked=EXTRAS | {"torch", "transformers", "peft", "triton"})
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.split() == ["e2b", "rollout64"]
