"""One job from the command line: `python -m flexgemma` types the config, builds the engine, runs the
task (job.py) and records it: summary.json, metrics.jsonl and the end table (tracking.py, metrics.py),
W&B (wandb_logger.py), the console and the job's log (console.py), one process per job directory
(joblock.py) and `--help` (help.py)."""
