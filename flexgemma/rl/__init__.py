"""RL fine-tuning with the engine generating: TRL's GRPOTrainer integration (rollout.py), the
trainer/engine views of one model (shared.py), rewards (rewards.py), a word tokenizer for the
random-weight test models (tokenizer.py). Needs the `rl` extra (TRL)."""
