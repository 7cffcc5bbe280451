"""The metrics catalogue: every name a job writes to summary.json, metrics.jsonl and W&B, with what
it means. Names are flat "group/name" keys, the same in all three places. The README links here.

`ROUND_METRICS` are the rows of metrics.jsonl (one a timed round; W&B history rows); `METRICS`
are the keys of summary.json (the W&B run summary). `engine/*` and `env/*` are families: every
key of the engine's build info and of the environment.
"""

from __future__ import annotations

ROUND_METRICS: dict[str, str] = {
    "round": "index of the timed round",
    "bench/round_seconds": "wall time of the round (s)",
    "bench/generated_tokens": "tokens generated in the round (output tokens)",
    "bench/prompt_tokens": "prompt tokens of the round's requests",
    "bench/compiled_in_round": "graphs torch.compile built inside the round (0 when the warm-up did its job)",
    "bench/reserved_growth_gib": "growth of the allocator's reserved memory inside the round (GiB; GPU)",
    "throughput/output_tok_s": "output (generated) tokens / round wall time (vLLM's output token throughput)",
    "throughput/total_tok_s": "(prompt + output) tokens / round wall time (vLLM's total token throughput)",
    "throughput/requests_s": "requests finished / round wall time",
    "latency/itl_mean_ms": "inter-token latency: mean gap between consecutive tokens of a completion, over all the "
                           "round's gaps (ms; percentiles in the summary)",
    "throughput/decode_tok_s": "decode tokens / time in decode steps",
    "throughput/prefill_tok_s": "prompt tokens / time in prefill steps",
    "bandwidth/decode_gb_s": "achieved memory bandwidth of decode (GB/s; estimate: weights + the KV each step reads)",
    "bandwidth/gpu_peak_gb_s": "the GPU's peak memory bandwidth (GB/s; GPU only)",
    "bandwidth/decode_pct_of_peak": "bandwidth/decode_gb_s as % of the GPU's peak (GPU only)",
    "scheduler/prefill_steps": "prefill steps of the round",
    "scheduler/decode_steps": "decode steps of the round",
    "scheduler/preemptions": "requests preempted (recomputed) for lack of KV pages",
    "scheduler/decode_batch_mean": "mean decode batch size",
    "latency/decode_gpu_step_ms": "the GPU's time in one decode step, mean (ms; async decode on a GPU, CUDA events)",
    "scheduler/gpu_idle_pct": "share of the decode loop the GPU sat idle between a step and the next one chained to "
                              "it, waiting for the host (%; async decode on a GPU; near 0 when the host keeps up)",
    "kv/prefix_hit_tokens": "prompt tokens whose KV came from the prefix cache (kv.prefix_cache; a GRPO group's copies)",
    "kv/prefix_hit_rate": "kv/prefix_hit_tokens / (kv/prefix_hit_tokens + throughput/prefill_tokens_computed)",
    "throughput/prefill_tokens_computed": "prompt (and recomputed) tokens the prefill steps computed",
    "kv/shared_pages_peak": "most KV pages held by more than one request at once (prefix cache; counted once in "
                            "memory/kv_in_use_peak_gib)",
    "determinism/run_to_run": "task=determinism row: two runs of the workload give identical tokens",
    "determinism/batch_invariant": "task=determinism row: seeded requests give the same tokens alone and in any batch",
    "determinism/graphs_vs_eager": "task=determinism row: CUDA-graph decode equals eager decode (GPU only)",
    "parity/token_match_pct": "task=parity row: % of greedy tokens equal to transformers generate, up to the first divergence",
    "parity/exact_prompts": "task=parity row: prompts whose tokens all match",
    "parity/prompts": "task=parity row: prompts compared",
    "parity/first_divergence": "task=parity row: earliest token index where any prompt diverges (-1: none)",
    # task=grpo: one row per optimizer step (docs/grpo.md)
    "grpo/step": "task=grpo row: the optimizer step (1-based)",
    "grpo/reward_mean": "mean reward over the step's completions (prompts_per_step x num_generations)",
    "grpo/reward_std": "standard deviation of the step's rewards",
    "grpo/rollout_s": "generation time of the step (s): adapter refresh + engine.generate (or TRL's generate)",
    "grpo/generate_s": "engine.generate of the step (s): grpo/rollout_s less the adapter refresh and TRL's work",
    "grpo/train_s": "the rest of the step (s): rewards, the trainer's logprob forward, loss, backward, optimizer",
    "grpo/refresh_ms": "engine.update_lora before the rollout: copy of the trainer's adapter + merge (ms)",
    "grpo/step_s": "wall time of the optimizer step (s)",
    "grpo/rollout_tok_s": "completion tokens / grpo/rollout_s",
    "grpo/logprob_absdiff_mean": "mean |engine logprob - trainer logprob| of the sampled tokens, before the update",
    "grpo/logprob_absdiff_max": "max of the same over the step's tokens",
    "grpo/kl_k3": "k3 estimate of KL(engine || trainer) per token: r - 1 - log r, r = p_trainer / p_engine",
    "grpo/router_flip_rate": "MoE models: share of (completion token, MoE layer) whose routed experts differ between "
                             "the rollout and the trainer's forward (NaN for dense models)",
    "grpo/is_ratio_p99": "99th percentile of the token importance ratio p_trainer / p_engine (before clipping)",
    "grpo/is_ratio_max": "largest token importance ratio of the step (before clipping at task.is_clip_max)",
    "memory/allocated_gib": "task=grpo row: memory allocated by torch at the end of the step (GiB; GPU)",
    "memory/rollout_peak_gib": "task=grpo row: peak allocated during the rollout (adapter refresh + generate; GiB; GPU)",
    "memory/train_peak_gib": "task=grpo row: peak allocated from the rollout's end to the step's end (rewards, the "
                             "trainer's forward and backward, the optimizer; GiB; GPU)",
    "grpo/compiled_graphs": "task=grpo row: graphs torch.compile built during the step (its time includes them)",
    "grpo/compiled_kernels": "task=grpo row: Triton kernels JIT-compiled during the step (its time includes them)",
    "grpo/wake_ms": "task.engine_sleep: engine.wake() before the step's rollout (ms; 0 on the first)",
}

METRICS: dict[str, str] = {
    # the job
    "status": "ok | invalid (a ConfigError: the configuration cannot run) | failed (error, traceback) | interrupted",
    "error": "why the job is invalid or failed",
    "traceback": "the failed job's traceback",
    "stderr_tail": "end of the stderr of a job whose process died (written by the sweep launcher)",
    "exit_error": "a job that recorded status ok but whose process then died on exit (written by the sweep launcher)",
    "model": "model name (+model=, or the checkpoint's)",
    "task": "bench | parity | determinism | drift | grpo | all",
    "choices": "the Hydra group choices (model, attn, cudagraph, quant, workload, experiment, ...); also the W&B tags",
    "overrides": "the job's command-line overrides; also the W&B run name",
    # throughput, over the timed rounds (build, compile, capture and warm-up are outside every window)
    "throughput/output_tok_s_median": "output tokens per second of wall time, median over rounds (what sweeps optimise)",
    "throughput/output_tok_s_best": "... best round",
    "throughput/total_tok_s_median": "(prompt + output) tokens per second of wall time, median over rounds",
    "throughput/total_tok_s_best": "... best round",
    "throughput/requests_s_median": "requests per second of wall time, median over rounds",
    "throughput/requests_s_best": "... best round",
    "throughput/decode_tok_s_median": "decode tokens per second of decode-step time, median",
    "throughput/decode_tok_s_best": "... best round",
    "throughput/prefill_tok_s_median": "prompt tokens per second of prefill-step time, median",
    "throughput/prefill_tok_s_best": "... best round",
    # latency, over every request of every timed round
    "latency/ttft_mean_ms": "time to first token, mean over requests (ms, from the start of generate())",
    "latency/ttft_p50_ms": "time to first token, median (ms)",
    "latency/ttft_p90_ms": "time to first token, 90th percentile (ms)",
    "latency/ttft_p99_ms": "time to first token, 99th percentile (ms)",
    "latency/tpot_mean_ms": "time per output token after the first, a request's mean; mean over requests (ms)",
    "latency/tpot_p50_ms": "time per output token, median over requests (ms)",
    "latency/tpot_p90_ms": "time per output token, 90th percentile (ms)",
    "latency/tpot_p99_ms": "time per output token, 99th percentile (ms)",
    "latency/itl_mean_ms": "inter-token latency: gap between consecutive tokens of a completion, mean over every "
                           "gap of every timed round (ms)",
    "latency/itl_p50_ms": "inter-token latency, median (ms)",
    "latency/itl_p90_ms": "inter-token latency, 90th percentile (ms)",
    "latency/itl_p99_ms": "inter-token latency, 99th percentile (ms; a decode step that waited for a prefill step shows here)",
    # memory
    "memory/weights_gib": "weight memory, 4-bit packing and quant states included (GiB)",
    "quant/fraction_4bit": "share of the parameters stored in 4 bits (quant=bnb4; 0 for bf16)",
    "memory/kv_pool_gib": "KV cache pool (GiB)",
    "memory/kv_in_use_peak_gib": "KV bytes in use at the busiest moment of the last timed round, every page group (GiB)",
    "memory/kv_prompt_peak_gib": "the most KV of prompt tokens held at once in the last timed round (GiB; a page shared "
                                 "by a GRPO group's copies counted once, a last partial page by its prompt tokens; "
                                 "measured at prefill steps)",
    "kv/prefix_hit_tokens": "last timed round: prompt tokens whose KV came from the prefix cache (kv.prefix_cache; a GRPO group's copies)",
    "kv/prefix_hit_rate": "kv/prefix_hit_tokens / (kv/prefix_hit_tokens + throughput/prefill_tokens_computed)",
    "throughput/prefill_tokens_computed": "last timed round: prompt (and recomputed) tokens the prefill steps computed",
    "kv/shared_pages_peak": "last timed round: most KV pages held by more than one request at once (prefix cache; counted once in "
                            "memory/kv_in_use_peak_gib)",
    "memory/graph_pool_gib": "CUDA-graph memory pool (GiB; GPU with cudagraph enabled)",
    "memory/peak_allocated_gib": "peak allocated by torch during the timed rounds (GiB; GPU)",
    "memory/peak_reserved_gib": "peak reserved by torch's allocator during the timed rounds (GiB; GPU)",
    "memory/peak_rss_gib": "peak resident memory of the process (GiB; CPU runs)",
    # build: compile and capture are never inside a throughput window
    "build/seconds": "building the engine: model, KV pool, compile, graph capture (s)",
    "engine/compile_capture_seconds": "compiling the kernels and capturing every CUDA-graph bucket, or the "
                                      "compiling warm-up step without graphs (s)",
    "engine/capture_seconds": "CUDA-graph capture of every bucket, compile included (s)",
    "engine/compiled_graphs": "graphs torch.compile built (fused glue, flex kernels, sampler); counted, never silent",
    "cudagraph/capture_seconds": "the same capture time, from the graphs themselves (s)",
    "cudagraph/num_graphs": "decode graphs captured (two per bucket: all-greedy, and sampling)",
    "cudagraph/buckets": "the bucket ladder (batch sizes)",
    "cudagraph/bucket_hits": "decode steps per bucket in the timed rounds ({bucket: steps})",
    "cudagraph/padding_waste": "padding rows / all rows replayed in the timed rounds (0 = no waste)",
    # bandwidth
    "bandwidth/decode_gb_s_median": "achieved decode memory bandwidth, median over rounds (GB/s; estimate)",
    "latency/decode_gpu_step_ms_median": "the GPU's time in one decode step, median over rounds (ms; GPU)",
    "scheduler/gpu_idle_pct_median": "the GPU idle between chained decode steps, % of the decode loop, median over "
                                     "rounds (GPU)",
    "bandwidth/decode_pct_of_peak_median": "... as % of the GPU's peak (GPU only)",
    "bandwidth/gpu_peak_gb_s": "the GPU's peak memory bandwidth (GB/s)",
    # bench bookkeeping
    "bench/rounds": "timed rounds",
    "bench/generated_tokens_per_round": "tokens generated per round",
    "bench/round_seconds_median": "wall time of a round, median (s)",
    "bench/first_round_ratio": "the first timed round's speed over the median round's (1 = as fast)",
    "bench/first_round_within_5pct": "the first timed round is within 5% of the median (nothing lazy inside it)",
    "bench/compiled_in_rounds": "graphs torch.compile built inside the timed rounds, all of them",
    "workload/prompts": "requests per round (prompts x workload.n)",
    "workload/prompt_tokens": "prompt tokens per round",
    "samples": "a few completions of the first timed round (decoded when the checkpoint has a tokenizer); "
               "all of them in completions.jsonl",
    "requests/errors": "requests of the first timed round that ended in an error (all of them: the job is failed)",
    "requests/total": "requests of the first timed round",
    "requests/first_error": "the first request error of the round, if any",
    # determinism and parity
    "determinism/run_to_run": "every timed round (bench) / two runs (determinism) give bitwise the same tokens",
    "determinism/batch_invariant": "seeded requests give the same tokens alone, and reversed in a batch",
    "determinism/graphs_vs_eager": "greedy tokens with CUDA graphs equal those of eager decode (GPU)",
    "parity/token_match_pct": "% of greedy tokens equal to transformers generate on the same weights",
    "parity/exact_prompts": "prompts whose greedy tokens all match",
    "parity/prompts": "prompts compared",
    "parity/first_divergence": "earliest divergent token index over the prompts (-1: none)",
    # task=grpo (docs/grpo.md)
    "grpo/steps": "optimizer steps taken",
    "grpo/reward_first5": "mean of grpo/reward_mean over the first five steps",
    "grpo/reward_last5": "mean of grpo/reward_mean over the last five steps",
    "grpo/step_s_median": "median step time (s)",
    "grpo/rollout_share": "sum of rollout time / sum of step time",
    "grpo/rollout_s_median": "median rollout time of a step (s)",
    "grpo/generate_s_median": "median time of a step's engine.generate() (s)",
    "grpo/train_s_median": "median training time of a step (s)",
    "grpo/refresh_ms_median": "median adapter refresh before a rollout (ms)",
    "grpo/rollout_tok_s_median": "median rollout tokens per second",
    "grpo/logprob_absdiff_mean": "mean over steps of the engine-vs-trainer mean |logprob difference|",
    "grpo/logprob_absdiff_max": "largest engine-vs-trainer |logprob difference| of the run",
    "grpo/kl_k3": "mean over steps of the k3 KL(engine || trainer) per token",
    "grpo/router_flip_rate": "mean over steps of the router flip rate (MoE models)",
    "grpo/is_ratio_max": "largest token importance ratio of the run (before clipping)",
    "grpo/generator": "flexgemma (the engine generates) | trl (TRL's transformers generate)",
    "grpo/trainer_forward": "what computed the trainer's logprobs: transformers, or engine (the engine's kernels)",
    "grpo/gradient_checkpointing": "whether the trainer's backward recomputed its activations (task.gradient_checkpointing)",
    "grpo/ratio_forward": "which trainer forward gave the IS ratio and mismatch metrics: separate (a no-grad pass) or loss (task.ratio_forward)",
    "grpo/engine_sleep": "whether the engine gave its KV cache back while the trainer computed (task.engine_sleep)",
    "memory/rollout_peak_gib": "largest rollout peak of the run (GiB; GPU)",
    "memory/train_peak_gib": "largest training peak of the run (GiB; GPU): with memory/rollout_peak_gib, which "
                             "phase sets the job's memory/peak_allocated_gib",
    "grpo/compiling_steps": "steps that compiled a graph or a Triton kernel (each new shape compiles once)",
    "grpo/step_s_median_warm": "median step time (s) of the steps that compiled nothing: the steady state",
    "grpo/train_s_median_warm": "median training time (s) of the steps that compiled nothing",
    "grpo/wake_ms_median": "median engine.wake() before a rollout (ms; task.engine_sleep)",
    "grpo/ranks": "processes that trained (torchrun/accelerate world size): one engine and one shard of prompts each",
    "grpo/wall_s": "wall time of trainer.train() (s)",
    "grpo/shared_base_bytes": "bytes of the weights trainer and engine share (one copy: base, norms, embeddings, "
                              "pristine copies of the adapted weights)",
    "grpo/merged_copy_bytes": "bytes of the engine's merged copies of the adapted weights (the only duplicate; 0 for "
                              "unmerged 4-bit projections)",
    "grpo/adapter_bytes": "bytes of the LoRA factors (float32 when the model is bf16: the trainer's master copy)",
    "grpo/optimizer_state_bytes": "bytes of the optimizer's state (AdamW: two moments of every LoRA factor)",
    "grpo/adapter_path": "the trained adapter, saved with peft (lora.path=... loads it into an engine)",
    # environment
    "env/python": "Python version",
    "env/torch": "torch version",
    "env/transformers": "transformers version",
    "env/triton": "triton version (none without it)",
    "env/cuda": "CUDA version torch was built with (none on CPU builds)",
    "env/driver": "NVIDIA driver (GPU)",
    "env/gpu": "GPU name (none on the CPU)",
    "env/git_sha": "flexgemma's git commit",
    "env/threads": "torch's intra-op threads (torch.get_num_threads())",
    "env/cpu": "CPU model (/proc/cpuinfo)",
    "env/omp_wait_policy": "OMP_WAIT_POLICY of the job (python -m flexgemma and the sweep launcher set PASSIVE unless set)",
    "env/peft": "peft version (none without it)",
    "env/bitsandbytes": "bitsandbytes version, from the package metadata (none without it; never imported for it)",
}

FAMILIES: dict[str, str] = {
    "engine/": "the engine's build info (device, dtype, attention_backend, kv_pages, page_size, kv_pool_bytes, "
               "params, weights, compile_glue, compiled_graphs, cudagraphs, max_model_len, build_seconds, "
               "compile_capture_seconds, kv_window_pages, ...)",
    "env/": "the environment",
    "kv/peak_pages_": "most pages of a page group in use at once in the last timed round (all: one group for "
                      "every layer; full / window: with kv.reclaim_sliding, the sliding layers' own group)",
}


def is_catalogued(name: str) -> bool:
    return name in METRICS or name in ROUND_METRICS or any(name.startswith(f) for f in FAMILIES)
