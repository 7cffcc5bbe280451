"""`python -m flexgemma --help`: what flexgemma is, its config groups and presets (one line each,
options read from conf/), and example commands. Hydra's own page stays at `--hydra-help`."""

from __future__ import annotations

from pathlib import Path

from flexgemma.config.compose import conf_dir

GROUPS = {  # group -> what it picks (its options are the files of conf/<group>/)
    "model": "the architecture: random weights, or a checkpoint with model.path=DIR",
    "quant": "weight storage: bf16, or bitsandbytes 4-bit",
    "lora": "a peft LoRA adapter of the given rank (none: no adapter)",
    "attn": "flex_attention block sizes and kernel options (attn.decode.block_n=...)",
    "kv": "the paged KV cache (kv.page_size, kv.max_pages, kv.prefix_cache)",
    "cudagraph": "the decode batch sizes captured as CUDA graphs",
    "workload": "the prompts: synthetic, the GPU speed set, or a JSONL file (workload.path=FILE)",
    "task": "what the job measures or trains",
    "logger": "Weights & Biases: offline (the default), online, or none",
}

PRESETS = {  # experiment preset -> one line; a preset missing here shows its file's first comment line
    "speed_e2b": "E2B speed workload: 64 prompts of 64-512 tokens + 512 new, batch 64 (GPU)",
    "speed_26b_a4b": "26B-A4B speed workload: prompts of 64-512 tokens + 256 new (GPU)",
    "rl_batch_e2b": "E2B, 256 sequences at once: an RL-sized batch (GPU)",
    "rl_batch_e4b": "E4B, 128 sequences at once (GPU)",
    "rl_batch_26b_a4b": "26B-A4B, 128 sequences at once (GPU)",
    "rl_batch_31b": "31B, 64 sequences at once (GPU)",
    "grpo_rollout": "a GRPO rollout: 32 long prompts x 8 samples, each prompt prefilled once (GPU)",
    "grpo_tiny": "GRPO that visibly learns on a CPU in about a minute (tiny, LoRA r16)",
    "grpo_e2b": "GRPO, E2B + LoRA r32, 8 prompts x 8 x 256: exact IS ratios (the engine's kernels in the trainer; GPU)",
    "grpo_26b_a4b": "GRPO, 26B-A4B 4-bit + LoRA r16, 4 prompts x 8 x 256, micro-batches of 8 (GPU)",
    "block_sweep": "sweep (-m): flex decode kernel options, a 12-job grid (GPU)",
    "bucket_sweep": "sweep (-m): CUDA-graph ladders, capture time and memory against padding (GPU)",
    "quant_compare": "sweep (-m): bf16 against bitsandbytes NF4 (GPU)",
    "optuna_kernels": "sweep (-m): Optuna over kernel options, 20 trials (the [optuna] extra; GPU)",
}

EXAMPLES = [
    ("python -m flexgemma", "benchmark the tiny model (under a minute on a CPU)"),
    ("python -m flexgemma model=e2b engine.max_batch_size=32", "a real architecture, random weights (GPU)"),
    ("python -m flexgemma model=e4b model.path=/ckpt/gemma-4-E4B-it", "a local checkpoint"),
    ("python -m flexgemma experiment=grpo_tiny", "train a LoRA with TRL's GRPO on a CPU"),
    ("python -m flexgemma -m attn.decode.block_n=16,32 +repeat=0,1", "a sweep: each point twice"),
    ("python -m flexgemma model=e2b --cfg job", "print the composed config, run nothing"),
]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def _default(group: str) -> str:
    """The group's entry in the defaults list of conf/config.yaml ("" for model and experiment)."""
    for line in (conf_dir() / "config.yaml").read_text().splitlines():
        key, _, value = line.strip().removeprefix("- ").partition(":")
        if key == group and value.strip():
            return value.split("#")[0].strip()
    return "tiny" if group == "model" else ""


def _first_comment(path: Path) -> str:
    for line in path.read_text().splitlines():
        text = line.lstrip("# ").strip()
        if line.startswith("#") and text and not text.startswith("@package"):
            return text
    return ""


def help_text() -> str:
    lines = [
        "flexgemma: a fast Gemma-4 generation engine for RL rollouts (paged KV cache, continuous batching,",
        "CUDA-graph decode, flex_attention, bitsandbytes 4-bit, peft LoRA), and the Hydra jobs around it. A job",
        "builds the engine, runs a task on a workload and writes summary.json, metrics.jsonl and a W&B run",
        "into outputs/DATE/TIME.",
        "",
        "usage: python -m flexgemma [GROUP=OPTION ...] [KEY=VALUE ...]      -m: a sweep over comma lists",
        "",
        "Config groups (GROUP=OPTION, the default marked *; every key: docs/configuration.md):",
    ]
    others = sorted(p.name for p in conf_dir().iterdir() if p.is_dir() and p.name not in GROUPS)
    described = {**GROUPS, **{g: "see docs/configuration.md" for g in others if g != "experiment"}}
    rows = [(group, what, [o + ("*" if o == _default(group) else "") for o in options(group)])
            for group, what in described.items()]
    rows += [("device", "where the job runs", ["auto*", "cpu", "cuda"]),
             ("hydra/launcher", "how a sweep runs its jobs: a process each (one process without [slurm])",
              ["flexgemma_local*", "flexgemma_slurm", "basic"])]
    for key, what, opts in rows:
        lines += [f"  {key:<15} {what}", f"  {'':<15}   {' '.join(opts)}"]
    lines += ["", "Experiment presets (experiment=NAME):"]
    for name in options("experiment"):
        text = PRESETS.get(name) or _first_comment(conf_dir() / "experiment" / f"{name}.yaml")
        lines.append(f"  {name:<17} {text}")
    lines += ["", "Examples:"]
    width = max(len(c) for c, _ in EXAMPLES)
    lines += [f"  {cmd:<{width}}   # {what}" for cmd, what in EXAMPLES]
    lines += ["", "More: --cfg job (the composed config), --hydra-help (Hydra's own flags), README.md and docs/."]
    return "\n".join(lines)
