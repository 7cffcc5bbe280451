"""Hostile and careless input (issue #16, items 4-9): every case either works or fails with a clear
error naming what is wrong, and nothing already accepted is changed or lost."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flexgemma.model.lora import LoraError
from flexgemma.tasks.drift import perturbed

from conftest import make_engine


# -- 4. LoRA updates are validated completely, then applied all at once ------------------------------
@pytest.fixture(scope="module")
def lora_engine():
    return make_engine("lora=r16")


def _last_key(sd: dict, part: str = "lora_B") -> str:
    return [k for k in sd if part in k][-1]  # the last tensor: a half-applied update would copy the rest


@pytest.mark.parametrize("bad, needle", [
    (lambda t: t.numpy(), r"is a ndarray, not a torch.Tensor"),
    (lambda t: t.tolist(), r"is a list, not a torch.Tensor"),
    (lambda t: torch.full_like(t, float("nan")), r"holds \d+ non-finite values"),
    (lambda t: torch.where(torch.arange(t.numel()).reshape(t.shape) == 3, float("inf"), t), r"holds 1 non-finite"),
    (lambda t: t.to(torch.int8), r"dtype torch.int8: LoRA factors must be floating point"),
    (lambda t: t > 0, r"dtype torch.bool"),
    (lambda t: t[:, :-1].clone(), r"has shape"),
])
def test_a_bad_lora_tensor_changes_nothing(lora_engine, bad, needle):
    lora = lora_engine.lora
    before_sd, before_merged, before_pristine = lora.state_dict(), lora.merged_digests(), lora.pristine_digests()
    update = perturbed(before_sd, 0.5, seed=7)  # every tensor new: any copy would show
    key = _last_key(update)
    update[key] = bad(update[key])
    with pytest.raises(LoraError, match=needle) as err:
        lora_engine.update_lora(update)
    assert key in str(err.value)
    assert lora.merged_digests() == before_merged
    assert lora.pristine_digests() == before_pristine
    after = lora.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before_sd.items())


# -- 5. a checkpoint's code never runs, asked or not -------------------------------------------------

from flexgemma.model.load import ModelLoadError, load_tokenizer  # noqa: E402


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _evil_tokenizer(path: Path, tokenizer_class: str) -> Path:
    """tokenizer_config.json pointing (auto_map) at a local module that leaves a marker when imported."""
    marker = path / "CODE_RAN"
    (path / "evil_tokenizer.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]}
    cfg["tokenizer_class"] = tokenizer_class
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return marker


@pytest.fixture
def no_stdin(monkeypatch):
    """Any prompt ('run the custom code? [y/N]') fails the test instead of waiting or being answered."""
    def refuse(*a, **k):
        raise AssertionError("stdin was read")

    monkeypatch.setattr("builtins.input", refuse)
    monkeypatch.setattr(sys, "stdin", type("NoStdin", (), {"read": refuse, "readline": refuse})())


def test_tokenizer_auto_map_to_custom_only_class_is_an_error_and_runs_nothing(checkpoint_with_tokenizer, tmp_path,
                                                                                no_stdin):
    path = _copy_checkpoint(checkpoint_with_tokenizer, tmp_path / "ckpt")
    marker = _evil_tokenizer(path, "EvilTokenizer")
    with pytest.raises(ModelLoadError, match="never runs code from a checkpoint"):
        load_tokenizer(path)
    assert not marker.exists()
    assert "evil_tokenizer" not in sys.modules


def test_tokenizer_auto_map_beside_a_transformers_class_loads_the_plain_class(checkpoint_with_tokenizer, tmp_path,
                                                                              no_stdin):
    path = _copy_checkpoint(checkpoint_with_tokenizer, tmp_path / "ckpt")
    marker = _evil_tokenizer(path, "PreTrainedTokenizerFast")
    tok = load_tokenizer(path)
    assert type(tok).__name__ != "EvilTokenizer" and not marker.exists()
    assert tok("hello world").input_ids == [2, 8, 9]


# -- 7 and 8. weights that would run wrong, and files that cannot be parsed --------------------------
from flexgemma import compose  # noqa: E402
from flexgemma.model.load import build_model  # noqa: E402


def _build(path: Path, *overrides: str):
    cfg = compose(["+model=tiny", f"model.path={path}", "device=cpu", *overrides])
    return build_model(cfg.model, torch.device("cpu"))


def _rewrite_weights(path: Path, change) -> str:
    """Applies change(tensors) to the checkpoint's model.safetensors; returns the changed key."""
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    tensors = load_file(str(f))
    key = change(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return key


@pytest.fixture
def ckpt(checkpoint_with_tokenizer, tmp_path):
    return _copy_checkpoint(checkpoint_with_tokenizer, tmp_path / "ckpt")


@pytest.mark.parametrize("name", ["model.pt", "pytorch_model.pth", "last.ckpt"])
def test_unreadable_weight_files_are_an_error_not_random_weights(ckpt, name):
    (ckpt / "model.safetensors").rename(ckpt / name)
    with pytest.raises(ModelLoadError, match=rf"cannot read \({name}\).*not run on random weights"):
        _build(ckpt)


def _nan_at(key_part: str, value: float = float("nan")):
    def change(tensors):
        key = next(k for k in sorted(tensors) if key_part in k)
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[5] = value
        return key
    return change


def _as(dtype, key_part: str):
    def change(tensors):
        key = next(k for k in sorted(tensors) if key_part in k)
        tensors[key] = (tensors[key] * 100).to(dtype) if dtype != torch.bool else tensors[key] > 0
        return key
    return change


@pytest.mark.parametrize("change, needle", [
    (_nan_at("layers.1.mlp.down_proj"), "holds 1 non-finite values"),
    (_nan_at("embed_tokens", float("-inf")), "holds 1 non-finite values"),
    (_as(torch.int8, "layers.0.self_attn.q_proj"), "dtype torch.int8 but the model's parameter is floating point"),
    (_as(torch.bool, "norm"), "dtype torch.bool but the model's parameter is floating point"),
])
def test_non_finite_or_integer_weights_are_errors_naming_the_tensor(ckpt, change, needle):
    key = _rewrite_weights(ckpt, change)
    with pytest.raises(ModelLoadError, match=needle) as err:
        _build(ckpt)
    assert key in str(err.value)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json"])
def test_invalid_json_names_the_file(ckpt, name):
    text = (ckpt / name).read_text()
    (ckpt / name).write_text(text[: len(text) // 2])  # a truncated download
    with pytest.raises(ModelLoadError, match=rf"{name}: invalid JSON at line \d+ column \d+"):
        _build(ckpt)


def test_a_json_array_config_names_the_file(ckpt):
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match=r"config.json: expected a JSON object"):
        _build(ckpt)


@pytest.mark.parametrize("keep", [0.5, 0.999, 4])
def test_truncated_safetensors_names_the_file(ckpt, keep):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)] if keep < 1 else data[:keep])
    with pytest.raises(ModelLoadError, match=r"model.safetensors: .*(truncated|corrupt)"):
        _build(ckpt)


def test_truncated_safetensors_names_the_file_in_the_4bit_build(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=r"model.safetensors: .*(truncated|corrupt)"):
        _build(ckpt, "quant=bnb4")


def test_adapter_files_that_cannot_be_parsed_name_the_file(lora_engine, tmp_path):
    lora_engine.lora.save(tmp_path / "a")
    adapter = tmp_path / "a"
    (adapter / "adapter_config.json").write_text('{"r": 16,')
    with pytest.raises(LoraError, match=r"adapter_config.json: invalid JSON"):
        make_engine(f"lora.path={adapter}")
    lora_engine.lora.save(tmp_path / "b")
    adapter = tmp_path / "b"
    f = adapter / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(LoraError, match=r"adapter_model.safetensors: .*(truncated|corrupt)"):
        make_engine(f"lora.path={adapter}")


# -- 6. sweeps: one job's I/O failure, bad launcher options, a job directory in use -------------------
from conftest import APP, APP_CONFIG, run_python  # noqa: E402

from flexgemma.run.joblock import JobLock, JobLockedError, holder  # noqa: E402


def _app(tmp_path: Path) -> Path:
    import textwrap

    (tmp_path / "app.py").write_text(textwrap.dedent(APP))
    (tmp_path / "app.yaml").write_text(APP_CONFIG)
    return tmp_path / "sweep"


@pytest.mark.parametrize("option, message", [
    ("parallel_jobs=-1", "hydra.launcher.parallel_jobs=-1: must be an integer >= 1"),
    ("parallel_jobs=0", "hydra.launcher.parallel_jobs=0: must be an integer >= 1"),
    ("timeout_min=0", "hydra.launcher.timeout_min=0: must be a positive number"),
])
def test_bad_launcher_options_are_a_clear_error_not_a_hang(tmp_path, option, message):
    sweep = _app(tmp_path)
    r = run_python(["app.py", "-m", "x=1,4", f"hydra.sweep.dir={sweep}", f"hydra.launcher.{option}"],
                   cwd=tmp_path, timeout=120)
    assert r.returncode != 0
    assert message in r.stderr
    assert not any(sweep.glob("*/.hydra"))  # no job started


def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _lock_as(job_dir: Path, pid: int, start=None) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "job.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "start": start}))


def test_a_job_dir_that_cannot_be_written_or_is_in_use_does_not_stop_the_sweep(tmp_path):
    from flexgemma.run.joblock import _me

    sweep = _app(tmp_path)
    sweep.mkdir()
    (sweep / "0").write_text("a file where job 0's directory should be")  # mkdir fails there, even as root
    mine = _me()
    _lock_as(sweep / "2", mine["pid"], mine["start"])  # a live process (this test) runs job 2
    _lock_as(sweep / "3", _dead_pid())  # job 3's last process died: its lock is stale
    r = run_python(["app.py", "-m", "x=0,1,3,4", f"hydra.sweep.dir={sweep}", "hydra.launcher.parallel_jobs=2"],
                   cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    table = r.stdout[r.stdout.index("sweep results:"):]
    rows = {line.split()[0]: line for line in table.splitlines()[2:] if line.strip()}
    assert rows["0"].split()[1] == "failed" and "summary.json not written" in rows["0"]
    assert rows["1"].split()[1] == "ok" and (sweep / "1" / ".hydra").is_dir()
    assert rows["2"].split()[1] == "running" and f"locked by process {mine['pid']}" in rows["2"]
    assert not (sweep / "2" / ".hydra").exists()  # never started in the locked directory
    assert rows["3"].split()[1] == "ok" and (sweep / "3" / ".hydra").is_dir()  # the stale lock did not stop it


def test_job_lock_is_exclusive_and_stale_locks_are_taken_over(tmp_path):
    from flexgemma.run.joblock import _me

    with JobLock(tmp_path / "a") as lock:
        assert holder(tmp_path / "a")["pid"] == os.getpid()
        with pytest.raises(JobLockedError, match=rf"in use by process {os.getpid()}"):
            JobLock(tmp_path / "a").acquire()
    assert not (tmp_path / "a" / "job.lock").exists() and not lock.held
    _lock_as(tmp_path / "b", _dead_pid())
    _lock_as(tmp_path / "c", os.getpid(), start="1")  # this pid, but another process's start time: reused
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "job.lock").write_text("{half")  # a lock whose writer died mid-write
    for d in "bcd":
        assert holder(tmp_path / d) is None
        with JobLock(tmp_path / d):
            assert json.loads((tmp_path / d / "job.lock").read_text()) == _me()


def test_run_job_in_a_locked_directory_touches_nothing(tmp_path):
    from flexgemma.run.joblock import _me
    from flexgemma.run.job import run_job

    mine = _me()
    _lock_as(tmp_path / "job", mine["pid"], mine["start"])
    (tmp_path / "job" / "metrics.jsonl").write_text("the running job's rows\n")
    cfg = compose(["+model=tiny", "device=cpu", "logger=none"])
    with pytest.raises(JobLockedError):
        run_job(cfg, tmp_path / "job")
    assert (tmp_path / "job" / "metrics.jsonl").read_text() == "the running job's rows\n"
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == ["job.lock", "metrics.jsonl"]


# -- 7. jobs: checked before the build, failed when nothing ran, bounded summaries --------------------
from flexgemma.run.job import run_job  # noqa: E402
from flexgemma.tasks.common import bounded  # noqa: E402
from flexgemma.run.tracking import RunDirError  # noqa: E402
from flexgemma.tasks.workload import WorkloadError  # noqa: E402

TINY_JOB = ["+model=tiny", "device=cpu", "logger=none", "kv.page_size=8", "kv.cpu_pages=80", "engine.max_model_len=256",
            "workload.num_prompts=2", "workload.max_new_tokens=3", "workload.rounds=1", "workload.warmup_rounds=0"]


@pytest.fixture
def no_build(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr("flexgemma.run.job.build_engine", refuse)


def test_sampling_settings_that_make_every_request_an_error_are_invalid_before_the_build(tmp_path, no_build):
    summary = run_job(compose([*TINY_JOB, "workload.top_p=0"]), tmp_path / "job", raise_errors=False)
    assert summary["status"] == "invalid" and "top_p=0.0 must be a number in (0, 1]" in summary["error"]
    with pytest.raises(WorkloadError, match="workload sampling settings cannot run"):
        run_job(compose([*TINY_JOB, "workload.top_p=0"]), tmp_path / "job2")


def test_every_bad_line_of_a_prompts_file_is_listed_before_the_build(tmp_path, no_build):
    lines = ['{"prompt_token_ids": [2, 5, 6]}', "not json", '{"prompt_token_ids": [2, true]}', '[1, 2]',
             '{"prompt": ""}', '{"text": "hi"}', '{"messages": [{"content": "no role"}]}',
             '{"prompt_token_ids": [2, -1]}', '{"prompt_token_ids": [2, 7]}']
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(lines) + "\n\n")
    cfg = compose([*TINY_JOB, "workload=jsonl", f"workload.path={f}", "workload.num_prompts=null"])
    summary = run_job(cfg, tmp_path / "job", raise_errors=False)
    assert summary["status"] == "invalid"
    assert "7 bad lines" in summary["error"]
    assert [ln.split(": ", 1)[0] for ln in summary["error"].splitlines()[1:]] == [
        f"  {f}:{n}" for n in (2, 3, 4, 5, 6, 7, 8)]


def test_prompts_too_long_for_the_engine_are_listed_before_any_runs(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt_token_ids": [2] * n}) for n in (4, 300, 5, 400)) + "\n")
    cfg = compose([*TINY_JOB, "workload=jsonl", f"workload.path={f}", "workload.num_prompts=null"])
    summary = run_job(cfg, tmp_path / "job", raise_errors=False)
    assert summary["status"] == "invalid" and "2 problems with the workload's requests" in summary["error"]
    assert "prompt 1: prompt of 300 tokens" in summary["error"] and "prompt 3: prompt of 400 tokens" in summary["error"]
    assert not (tmp_path / "job" / "completions.jsonl").exists()  # nothing ran


def test_a_job_whose_every_request_errored_is_failed(tmp_path, monkeypatch):
    from flexgemma import RequestOutput
    from flexgemma.builder import build_engine

    def erroring(cfg, demand=None):
        engine = build_engine(cfg, demand)
        engine.generate = lambda prompts, params, **k: [
            RequestOutput(i, list(p), [], [], "error", error="sampling blew up") for i, p in enumerate(prompts)]
        return engine

    monkeypatch.setattr("flexgemma.run.job.build_engine", erroring)
    summary = run_job(compose(TINY_JOB), tmp_path / "job", raise_errors=False)
    assert summary["status"] == "failed" and summary["requests/errors"] == summary["requests/total"] == 2
    assert "every one of the 2 requests ended in an error" in summary["error"] and "sampling blew up" in summary["error"]


def test_summary_samples_are_bounded(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt_token_ids": [2] + list(range(3, 203))}) + "\n")
    cfg = compose([*TINY_JOB, "workload=jsonl", f"workload.path={f}"])
    summary = run_job(cfg, tmp_path / "job")
    prompt = summary["samples"][0]["prompt"]
    assert prompt[:16] == [2] + list(range(3, 18)) and prompt[-16:] == list(range(187, 203))
    assert prompt[16] == "…[169 of 201 items left out]…" and len(prompt) == 33
    row = json.loads((tmp_path / "job" / "completions.jsonl").read_text().splitlines()[0])
    assert len(row["prompt"]) == 201  # completions.jsonl keeps the whole prompt
    text = bounded("a" * 10_000_000 + "END")
    assert len(text) < 300 and text.endswith("aEND") and "10000003 chars" in text
    assert bounded([{"role": "user", "content": "b" * 5000}])[0]["content"].count("b") == 240


# -- 8. unwritable run directories are named -------------------------------------------------------------
def test_a_run_dir_that_cannot_be_written_is_named(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(RunDirError, match=rf"cannot write the job's files in {tmp_path / 'file' / 'job'}"):
        run_job(compose(TINY_JOB), tmp_path / "file" / "job")


# -- 8. reports survive any swept value -------------------------------------------------------------------
HOSTILE_VALUES = [r"$\undefinedcommand{x}$", "a$b", "$x^$", "<script>alert(1)</script>", "100%_{}", "x" * 5000,
                  "line1\nline2"]


def test_report_survives_any_swept_value(tmp_path):
    from PIL import Image

    from flexgemma.report import build_report
    from conftest import BASE, cpu_summary, write_job

    sweep = tmp_path / "sweep"
    for n, v in enumerate(HOSTILE_VALUES):
        overrides = [*BASE, f"model.name={v}", f"attn.decode.block_n={16 * (n + 1)}"]
        write_job(sweep / str(n), overrides, cpu_summary(1000.0 + n, model=v), rounds=[1000.0 + n] * 3)
    report = build_report([sweep])
    assert {p.path.name for p in report.plots} >= {"throughput_vs_model_name.png", "throughput_rounds.png"}
    for plot in report.plots:
        with Image.open(plot.path) as im:
            assert im.size[0] < 4000  # a 5000-character value is shortened, not a 46,000-pixel-wide plot
    html = (sweep / "report.html").read_text()
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "$\\undefinedcommand{x}$" in (sweep / "report.md").read_text()


# -- 9. an offline W&B run makes no network calls ---------------------------------------------------------
OFFLINE_RUN = """
import sys
from pathlib import Path
from flexgemma import compose
from flexgemma.run.wandb_logger import WandbRun

out = Path(sys.argv[1])
cfg = compose(["+model=tiny", "logger=wandb_offline"])
run = WandbRun.start(cfg, out, {"name": "net", "group": "g", "job_type": "bench", "tags": []}, {"env/python": "3"})
run.log_round({"round": 0, "throughput/total_tok_s": 1.0})
run.set_summary({"status": "ok"})
run.finish("ok")
print("RUN_OK")
"""


def _wandb_env(tmp_path: Path) -> dict:
    from conftest import ROOT as root

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=str(root), WANDB_CONFIG_DIR=str(tmp_path / "cfg"), WANDB_CACHE_DIR=str(tmp_path / "cache"),
               WANDB_DATA_DIR=str(tmp_path / "data"), WANDB_SILENT="true")
    return env


def test_offline_wandb_run_connects_to_nothing_in_any_process(tmp_path):
    """strace over the job's process and every child (wandb-core, wandb-symon): not one AF_INET/AF_INET6
    connect (DNS included: a resolver connects its UDP socket to port 53 first)."""
    import shutil
    import subprocess

    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed")
    script = tmp_path / "offline_run.py"
    script.write_text(OFFLINE_RUN)
    trace = tmp_path / "trace.txt"
    r = subprocess.run([strace, "-f", "-qq", "-e", "trace=connect", "-o", str(trace), sys.executable, str(script),
                        str(tmp_path / "job")], capture_output=True, text=True, env=_wandb_env(tmp_path), timeout=300)
    if r.returncode != 0 and "ptrace" in r.stderr:
        pytest.skip(f"strace cannot trace here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0 and "RUN_OK" in r.stdout, r.stderr[-3000:]
    calls = [line for line in trace.read_text().splitlines() if "AF_INET" in line]
    assert calls == []
    assert len(list((tmp_path / "job").glob("wandb/offline-run-*/run-*.wandb"))) == 1  # the run was written


def test_offline_wandb_run_with_networking_denied(tmp_path, monkeypatch):
    """In this process: name resolution and IP connects raise (and are recorded); the run still works,
    and wandb-core is started with its own telemetry off (--no-observability)."""
    from flexgemma.run.wandb_logger import WandbRun, offline_runs, read_offline_run

    attempts = []

    def deny_resolve(host, *a, **k):
        attempts.append(("getaddrinfo", host))
        raise socket.gaierror("networking denied by the test")

    real_connect = socket.socket.connect

    def deny_connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(("connect", address))
            raise OSError("networking denied by the test")
        return real_connect(self, address)

    monkeypatch.delenv("WANDB_ERROR_REPORTING", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", deny_resolve)
    monkeypatch.setattr(socket.socket, "connect", deny_connect)
    cfg = compose(["+model=tiny", "logger=wandb_offline"])
    run = WandbRun.start(cfg, tmp_path, {"name": "net", "group": "g", "job_type": "bench", "tags": []}, {})
    assert run is not None
    cmdlines = [_safe_read(p).split(b"\0") for p in Path("/proc").glob("[0-9]*/cmdline")]
    core_cmdlines = [c for c in cmdlines if c[0].endswith(b"wandb-core")
                     and str(os.getpid()).encode() in c[c.index(b"--pid") + 1:][:1]]
    run.log_round({"round": 0, "throughput/total_tok_s": 2.0})
    run.finish("ok")
    assert attempts == []
    assert core_cmdlines and all(b"--no-observability" in c for c in core_cmdlines)
    assert os.environ["WANDB_ERROR_REPORTING"] == "false"
    monkeypatch.undo()  # wandb's reader below is a subprocess of its own
    wb = read_offline_run(offline_runs(tmp_path)[0])
    assert wb["history"] == [{"round": 0, "throughput/total_tok_s": 2.0}]


def _safe_read(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError:
        return b""


def test_numpy_integers_are_accepted_as_prompt_token_ids():
    from flexgemma.tasks.workload import _tokenise, record_problem

    ids = [np.int64(2), np.int32(7), 9]
    assert record_problem({"prompt_token_ids": ids}) is None
    got, _ = _tokenise({"prompt_token_ids": ids}, None, "here")
    assert got == [2, 7, 9] and all(type(t) is int for t in got)
    assert record_problem({"prompt_token_ids": [np.float64(2.0)]}) is not None


def test_a_huge_error_message_is_bounded_in_the_summary(tmp_path, monkeypatch):
    def explode(*a, **k):
        raise RuntimeError("x" * 5_000_000)

    monkeypatch.setattr("flexgemma.run.job.build_engine", explode)
    summary = run_job(compose(TINY_JOB), tmp_path / "job", raise_errors=False)
    assert summary["status"] == "failed" and summary["error"].startswith("RuntimeError: xxx")
    assert len(summary["error"]) < 20_100 and "chars left out" in summary["error"]
    assert (tmp_path / "job" / "summary.json").stat().st_size < 100_000
