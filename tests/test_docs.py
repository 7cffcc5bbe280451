"""Every example of README.md and docs/*.md, as written, and CI installing as the README says.

- ```python blocks: a document's blocks run in order in one fresh interpreter (one namespace, as a
  reader pastes them one after another), in a temporary directory.
- ```bash blocks, command by command (continuation lines joined). `python -m flexgemma ...` runs as
  written where a CPU can run it (the tiny models, one job, no W&B login) or only prints the config
  (`--cfg`); every other flexgemma command line (a GPU model, a checkpoint, a sweep, torchrun) is
  composed through the CLI's own checks (unknown keys, models, presets, extras), since a CPU cannot
  run it. Other commands follow RULES, each with why it does not run here.
- A block after `<!-- not run: REASON -->` is skipped for that reason; a block after
  `<!-- file: NAME -->` is written to NAME where its document's commands run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from flexgemma import compose

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- (not run|file): (.+?) -->")

RULES = [  # (how a command starts, why it does not run here; a word ending in / is a path prefix)
    (["python3.11", "-m", "venv"], "makes the environment: README's install lines are .ci/run's"),
    (["pip"], "an install: README's install lines are .ci/run's (test_ci_installs_as_the_readme_says)"),
    (["python", "-m", "pytest"], "the test suite itself"),
    (["python", "-m", "flexgemma.report"], "needs a sweep's directory (DATE/TIME): tests/test_report.py runs it"),
    (["python", "experiments/"], "a GPU benchmark script (experiments/)"),
]
CPU_MODELS = ("tiny", "tiny_moe")
# run before a document's python examples: a request that ends in an error fails the example (an
# example's token ids outside the model's vocabulary would otherwise pass unnoticed)
STRICT = """
import flexgemma.engine.engine as _engine
_generate = _engine.Engine.generate
def _checked(self, *args, **kwargs):
    outs = _generate(self, *args, **kwargs)
    errors = [o.error for o in outs if o.finish_reason == "error"]
    assert not errors, f"a request of the example ended in an error: {errors[0]}"
    return outs
_engine.Engine.generate = _checked
"""


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    code: str
    mark: Optional[tuple[str, str]]  # ("not run", reason) or ("file", name)


def blocks(doc: Path) -> list[Block]:
    out, lines, i = [], doc.read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, start = lines[i][3:].strip(), i
            before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            mark = MARK.fullmatch(before.strip())
            i += 1
            while not lines[i].startswith("```"):
                i += 1
            out.append(Block(doc, start + 1, lang, "\n".join(lines[start + 1:i]) + "\n",
                             mark.groups() if mark else None))
        i += 1
    return out


def runnable(doc: Path, lang: str) -> list[Block]:
    return [b for b in blocks(doc) if b.lang == lang and (b.mark or ("",))[0] != "not run"]


def commands(code: str) -> list[list[str]]:
    """The block's commands as argument lists (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [args for args in (shlex.split(line, comments=True) for line in joined.splitlines()) if args]


def has_rule(args: list[str]) -> bool:
    return any(len(args) >= len(p) and all(a == w or (w.endswith("/") and a.startswith(w)) for a, w in zip(args, p))
               for p, _ in RULES)


def flexgemma_args(args: list[str]) -> Optional[list[str]]:
    """The arguments after `-m flexgemma` (python, torchrun or accelerate launch), else None."""
    for i in range(len(args) - 1):
        if args[i] == "-m" and args[i + 1] == "flexgemma":
            return args[i + 2:]
    return None


def first_point(value: str) -> str:
    """A sweep value's first choice (top-level commas only: [1,2] is one value)."""
    depth = 0
    for i, ch in enumerate(value):
        depth += ch in "[{(" and 1 or ch in "]})" and -1 or 0
        if ch == "," and depth == 0:
            return value[:i]
    return value


def composed(args: list[str]):
    """The config a command line composes to (its sweep's first point), through the CLI's checks."""
    overrides, skip = [], False
    for a in args:
        if skip or a in ("-m", "--multirun"):
            skip = False
            continue
        if a.startswith("-"):
            skip = a in ("--cfg", "-c", "--package", "-p", "--info")
            continue
        key, eq, value = a.partition("=")
        overrides.append(f"{key}={first_point(value)}" if eq else a)
    return compose(overrides)


def runs_on_a_cpu(args: list[str], cfg) -> bool:
    if "--cfg" in args or "-c" in args:
        return True  # prints the config; builds nothing
    logger = str(getattr(cfg.logger.kind, "value", cfg.logger.kind))
    return cfg.model.name in CPU_MODELS and not {"-m", "--multirun"} & set(args) and logger != "wandb_online"


def run(argv: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def write_files(doc: Path, where: Path) -> None:
    for b in blocks(doc):
        if b.mark and b.mark[0] == "file":
            (where / b.mark[1]).write_text(b.code)


def doc_id(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in DOCS if runnable(d, "python")], ids=doc_id)
def test_python_examples_run_as_written(doc, tmp_path):
    write_files(doc, tmp_path)
    code = STRICT + "\n".join(b.code for b in runnable(doc, "python"))
    (tmp_path / "example.py").write_text(code)
    r = run([sys.executable, "example.py"], tmp_path)
    assert r.returncode == 0, f"{doc_id(doc)}'s python examples failed:\n{r.stderr[-4000:]}"


_RAN: dict[str, str] = {}  # a command run once for every document that shows it


@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in DOCS if runnable(d, "bash")], ids=doc_id)
def test_command_examples_compose_and_cpu_ones_run(doc, tmp_path):
    write_files(doc, tmp_path)
    for block in runnable(doc, "bash"):
        for args in commands(block.code):
            where = f"{doc_id(doc)}:{block.line}: {shlex.join(args)}"
            cli = flexgemma_args(args)
            if cli is None:
                assert has_rule(args), f"{where}: no rule for this command (add one to RULES, with why)"
                continue
            cfg = composed(cli)  # a typo, an unknown key or preset, a missing extra: an error here
            if args[0] == "python" and runs_on_a_cpu(cli, cfg) and shlex.join(args) not in _RAN:
                before = set(tmp_path.rglob("summary.json"))
                r = run([sys.executable, *args[1:]], tmp_path)
                assert r.returncode == 0, f"{where}\n{(r.stdout + r.stderr)[-4000:]}"
                for path in set(tmp_path.rglob("summary.json")) - before:  # every request of the job ran
                    summary = json.loads(path.read_text())
                    assert summary["status"] == "ok" and not summary.get("requests/errors"), (where, summary)
                _RAN[shlex.join(args)] = where


def test_every_block_runs_or_says_why():
    skipped = [b for d in DOCS for b in blocks(d) if b.mark and b.mark[0] == "not run"]
    assert all(len(b.mark[1]) > 10 for b in skipped)
    assert len(skipped) <= 3, [f"{doc_id(b.doc)}:{b.line}" for b in skipped]  # a short list, each with its reason
    examples = [b for d in DOCS for b in blocks(d) if b.lang in ("python", "bash")]
    assert len(examples) >= 25  # the parser finds the examples (30 when this was written)


def test_ci_installs_as_the_readme_says():
    readme = (ROOT / "README.md").read_text()
    install = next(b for b in blocks(ROOT / "README.md")
                   if b.lang == "bash" and readme.rfind("## Install", 0, readme.find(b.code)) >= 0)
    ci = [args for args in commands((ROOT / ".ci" / "run").read_text())]
    for args in commands(install.code):
        assert args in ci, f".ci/run does not run README's install line: {shlex.join(args)}"
    two = next(b for b in blocks(ROOT / "README.md") if "python -m pytest -q" in b.code)
    test_command = next(a for a in commands(two.code) if a[:3] == ["python", "-m", "pytest"])
    assert test_command in ci, f".ci/run does not run README's test command: {shlex.join(test_command)}"
    pip = [a for a in ci if a[:2] == ["pip", "install"] or a[2:4] == ["pip", "install"]]
    assert pip and not any("-c" in a or "--constraint" in a or "-r" in a for a in pip), pip  # the README's, nothing more
