#!/usr/bin/env bash
# The GPU lab, stage by stage: each stage runs preset commands (`python -m flexgemma experiment=...`,
# a sweep with -m compared by `python -m flexgemma.report`), the GPU tests, or a profiler. A device
# call may run 10 minutes, so a call names the stages it runs (they run in this file's order):
#   bash experiments/gpu_suite.sh STAGE...
#   SWEEP="experiment=rl_batch_31b kernels.prefill_full_blocks=true,false" bash experiments/gpu_suite.sh sweep
#   MODEL=31b ROWS=64 CONTEXT=416 bash experiments/gpu_suite.sh decode_sweep
#   PROBE=moe_tiles PROBE_MOE=bnb4 bash experiments/gpu_suite.sh probe
#   INV_LINEAR="e2b:64,256" K_CHUNKS=512,2048 INV_FORMS=flat,split,flat_tma,split_tma bash experiments/gpu_suite.sh bench_inv_linear
#   FORMS_4BIT=dot_prmt,dot_w_prmt,dotk4_prmt BATCHES_4BIT=32,128 WARPS_4BIT=4 bash experiments/gpu_suite.sh bench_4bit_forms
# Stages (in this order): tests tests_kernels invariant_tests invariant_tests_moe trainable_tests speed_e2b vs_hf_e2b vs_hf_26b rl_e2b rl_e4b rl_26b rl_26b_bnb4 rl_31b rl_31b_bnb4 inv_e2b inv_e2b_64 inv_e4b inv_26b inv_26b_bnb4 inv_31b speed_inv ab_inv_flatten_e2b ab_inv_flatten_26b_bnb4 bench_inv_linear bench_inv_linear_trainer ab_inv_k_chunk_e2b ab_inv_split_sum_e2b ab_inv_keys ab_inv_loads_e2b ab_inv_26b_bnb4_experts ab_inv_26b_bnb4_subtiles invariant_tests_scale ab_inv_26b_bnb4_scale ab_prefill_page_check ab_prefill_attention ab_temperature ab_31b_full_blocks ab_31b_fused_kv ab_31b_bnb4_dequant ab_26b_sort ab_26b_bnb4_slots ab_26b_bnb4_prefetch ab_inv_26b_bnb4_prefetch ab_26b_bnb4_lookup ab_inv_26b_bnb4_lookup ab_26b_bnb4_dequant sweep prefix_e2b prefix_26b exact_gap_e2b exact_gap_26b profile_trainer_e2b profile_trainer_e2b_mb64 profile_trainer_26b profile_trainer_26b_mb16 grpo_e2b grpo_e2b_exact grpo_e2b_exact_separate grpo_e2b_exact_keep grpo_e2b_exact_keep8 grpo_e2b_exact_reference grpo_e2b_exact_mb64 grpo_e2b_exact_reference_mb64 grpo_e2b_exact_mb64_torch_recompute grpo_e2b_exact_mb64_pointers grpo_26b_exact grpo_26b_exact_reference grpo_26b_exact_mb32 grpo_26b_exact_sleep grpo_26b_exact_mb32_sleep grpo_26b_exact_mb16_sleep grpo_e2b_trl grpo_26b grpo_tests grpo_2gpu profile_decode profile_decode_inv profile_prefill_inv profile_prefill_masks probe decode_sweep profile_round bench_kernels bench_4bit_forms ablate_4bit ncu_4bit_up speed_old_new
# Each job's directory (summary.json, metrics.jsonl, config_resolved.yaml) and each sweep's report.md
# go to $WORK (default /tmp/flexgemma_gpu); at the end they are packed into $OUT/results.tgz and a
# digest is printed. Expects the wheels of
# `../shared/device/fetch-wheels --with-wandb submitit==1.5.4 hydra-submitit-launcher==1.2.0` in .whl/
# (carried with the call: run(carry=[".whl"])).
set -u
OUT=${OUT:-/tmp/flexgemma_out}
WORK=${WORK:-/tmp/flexgemma_gpu}
mkdir -p "$OUT" "$WORK"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE WORK
# weights stay behind (a GRPO job's adapter and checkpoints pushed results.tgz past what a call returns)
pack() { tar czf "$OUT/results.tgz" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' --exclude='*.pth' \
  -C "$WORK" . 2>/dev/null; }
trap pack EXIT
ARGS=" $* "
# the whole call ends by $BUDGET seconds (the device tool's limit is 600 per call): a stage's limit is
# cut to what is left, and a stage with under 30 s left is skipped
DEADLINE=$(( $(date +%s) + ${BUDGET:-575} ))
run() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  [[ "$ARGS" == *" $name "* ]] || return 0
  local t0=$(date +%s) left=$(( DEADLINE - $(date +%s) ))
  (( left < limit )) && limit=$left
  if (( limit < 30 )); then echo "== $name skipped: ${left}s left"; return 0; fi
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 ))s"
  grep -E "passed|failed|^FAILED|Error:|tok/s|output tok|peak memory|status|^  [a-z/_.]+ *=|verdict|EQUAL|PARTS|bits equal| ms \\(median|forward\+backward|^trainer\.|^# profile|winner|faster|within noise|GRPO| ok$|parity|best|^decode |sum over|GPU per|  host |^ablate " \
    "$WORK/$name.log" | grep -v DEBUG | tail -25
  pack
}
job() {  # name overrides...: one job of a preset into $WORK/name (its summary table closes the log)
  local name=$1; shift
  python3 -m flexgemma "$@" logger=none hydra.run.dir="$WORK/$name"
}
sweep() {  # name overrides...: a multirun (each job in its own process) into $WORK/name, then its report
  local name=$1; shift
  python3 -m flexgemma -m "$@" logger=none hydra.sweep.dir="$WORK/$name"; python3 -m flexgemma.report "$WORK/$name"
}
export -f job sweep
MODEL=${MODEL:-31b} ROWS=${ROWS:-64} CONTEXT=${CONTEXT:-416} QUANT=${QUANT:-} LORA=${LORA:-}

# 26B-A4B cut to its first six layers (five sliding, one full) so that float32 fits beside the tests
L6="model.hf_config.num_hidden_layers=6 model.hf_config.layer_types=[sliding_attention,sliding_attention,sliding_attention,sliding_attention,sliding_attention,full_attention]"
# correctness, not timings: the GPU test files and the float32 26B-A4B parity job side by side
gpu_tests() {
  local pids=() f
  for f in "gpu tests/engine/test_gpu_engine.py tests/model/test_gpu_model.py" "moe_quant tests/model/test_moe.py tests/model/test_quant.py" "lora tests/model/test_lora_gpu.py tests/model/test_weights.py"; do
    set -- $f
    local name=$1; shift
    timeout 400 python3 -m pytest -q -p no:logging -m gpu --durations=0 -s "$@" > "$WORK/tests_$name.log" 2>&1 &
    pids+=($!)
  done
  timeout 400 python3 -m flexgemma +model=26b_a4b model.dtype=float32 $L6 task=parity task.max_prompts=4 \
    workload.num_prompts=4 workload.max_new_tokens=48 cudagraph=off logger=none device=cuda \
    hydra.run.dir="$WORK/parity26_fp32" > "$WORK/tests_parity26_fp32.log" 2>&1 &
  pids+=($!)
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  grep -hE "passed|failed|^FAILED|^E  .{0,200}$|parity/|fraction_4bit|peak_allocated" "$WORK"/tests_*.log | head -60
  return $rc
}
export -f gpu_tests
export L6
run tests 420 bash -c gpu_tests
run tests_kernels 300 python3 -m pytest -q -p no:logging -m gpu --durations=0 -s tests/model/test_moe_kernel.py \
  tests/model/test_ptx_lookup.py tests/model/test_linear4bit.py tests/engine/test_sampling.py
# batch invariance and the trainer through the engine's kernels (issues 34, 35): every model's shapes
run invariant_tests 540 python3 -m pytest -q -p no:logging -m gpu --durations=0 tests/engine/test_invariant.py
run invariant_tests_moe 400 python3 -m pytest -q -p no:logging -m gpu --durations=0 tests/engine/test_invariant.py -k 26b
run trainable_tests 400 python3 -m pytest -q -p no:logging -m gpu --durations=0 tests/rl/test_trainable.py

# The numbers of README.md and docs/results.md, each its preset's command (experiments/RESULTS.md)
run speed_e2b 240 bash -c 'job speed_e2b experiment=speed_e2b'
# transformers' generate beside the engine in one process (the speed-ups): what no preset measures
run vs_hf_e2b 300 python3 experiments/bench_vs_hf.py +model=e2b +experiment=speed_e2b --hf-rounds 1 --out "$WORK/vs_hf_e2b.json"
run vs_hf_26b 330 python3 experiments/bench_vs_hf.py +model=26b_a4b +experiment=speed_26b_a4b workload.num_prompts=8 \
  --batch-sizes 8 --hf-rounds 1 --out "$WORK/vs_hf_26b.json"
run rl_e2b 570 bash -c 'sweep rl_e2b experiment=rl_batch_e2b workload.num_prompts=64,256'
run rl_e4b 330 bash -c 'job rl_e4b experiment=rl_batch_e4b'
run rl_26b 570 bash -c 'sweep rl_26b experiment=rl_batch_26b_a4b workload.num_prompts=8,128'
run rl_26b_bnb4 570 bash -c 'sweep rl_26b_bnb4 experiment=rl_batch_26b_a4b quant=bnb4 workload.num_prompts=8,128'
run rl_31b 330 bash -c 'job rl_31b experiment=rl_batch_31b'
run rl_31b_bnb4 400 bash -c 'job rl_31b_bnb4 experiment=rl_batch_31b quant=bnb4 workload.num_prompts=128'
# what engine.batch_invariant costs (issue 34): each preset's round with it off, then on, in one call
run inv_e2b 570 bash -c 'sweep inv_e2b experiment=rl_batch_e2b engine.batch_invariant=false,true'
run inv_e2b_64 570 bash -c 'sweep inv_e2b_64 experiment=rl_batch_e2b workload.num_prompts=64 engine.batch_invariant=false,true'
run inv_e4b 570 bash -c 'sweep inv_e4b experiment=rl_batch_e4b engine.batch_invariant=false,true'
run inv_26b 570 bash -c 'sweep inv_26b experiment=rl_batch_26b_a4b engine.batch_invariant=false,true'
run inv_26b_bnb4 570 bash -c 'sweep inv_26b_bnb4 experiment=rl_batch_26b_a4b quant=bnb4 engine.batch_invariant=false,true'
run inv_31b 570 bash -c 'sweep inv_31b experiment=rl_batch_31b engine.batch_invariant=false,true'
run speed_inv 240 bash -c 'job speed_inv experiment=speed_e2b engine.batch_invariant=true'
# the invariant kernels' chunk loops as one loop (kernels.invariant_flatten, the default; same bits) against nested
run ab_inv_flatten_e2b 570 bash -c 'sweep ab_inv_flatten_e2b experiment=rl_batch_e2b engine.batch_invariant=true \
  kernels.invariant_flatten=false,true'
run ab_inv_flatten_26b_bnb4 570 bash -c 'sweep ab_inv_flatten_26b_bnb4 experiment=rl_batch_26b_a4b quant=bnb4 \
  engine.batch_invariant=true kernels.invariant_flatten=false,true'
# the invariant product against cuBLAS on each dense model's decode-step shapes, over kernels.invariant_k_chunk
# (its float32 partials), the split and the tiles (experiments/bench_invariant_linear.py); then the engine's A/B
run bench_inv_linear 420 bash -c 'for mr in ${INV_LINEAR:-e2b:64,256 e4b:128 31b:64}; do python3 experiments/bench_invariant_linear.py \
  --model ${mr%%:*} --rows ${mr#*:} --k-chunks ${K_CHUNKS:-512,1024,2048,4096} --forms ${INV_FORMS:-flat,split,split_last} --out "$WORK/bench_inv_linear_${mr%%:*}.json"; done'
# the same products at a trainer micro-batch's rows (task.trainer_forward=engine computes through them)
run bench_inv_linear_trainer 300 python3 experiments/bench_invariant_linear.py --model e2b --rows 8192 --k-chunks 512 --forms ${INV_FORMS:-fold,flat} \
  --out "$WORK/bench_inv_linear_trainer.json"
run ab_inv_k_chunk_e2b 570 bash -c 'sweep ab_inv_k_chunk_e2b experiment=rl_batch_e2b engine.batch_invariant=true \
  kernels.invariant_k_chunk=512,2048'
# a split product's chunks added by a second kernel or by each tile's last program (speed only, the same bits),
# at a GRPO rollout's 64 rows and at 256 (AB_ROWS: other row counts; AB_KEYS: other speed-only keys of the products)
run ab_inv_split_sum_e2b 570 bash -c 'for rows in ${AB_ROWS:-64 256}; do sweep ab_inv_split_sum_e2b_$rows experiment=rl_batch_e2b \
  workload.num_prompts=$rows engine.batch_invariant=true ${AB_KEYS:-kernels.invariant_split_sum=kernel,last_program}; done'
# a speed-only key of the invariant products on other presets, default first (AB_PRESETS, AB_KEYS): the split
# threshold measured on E2B (48 against 264) on E4B at 128 rows and 31B at 64 (31B's 64 rows need an H200)
run ab_inv_keys 570 bash -c 'for preset in ${AB_PRESETS:-rl_batch_e4b rl_batch_31b}; do sweep ab_inv_keys_$preset \
  experiment=$preset engine.batch_invariant=true ${AB_KEYS:-kernels.invariant_split_below_tiles=48,264}; done'
# the fold kernel's blocks through per-element pointers or tensor descriptors (speed only, the same bits)
run ab_inv_loads_e2b 570 bash -c 'for rows in ${AB_ROWS:-64 256}; do sweep ab_inv_loads_e2b_$rows experiment=rl_batch_e2b \
  workload.num_prompts=$rows engine.batch_invariant=true kernels.invariant_loads=pointers,tma; done'

# the invariant routed experts' other form (kernels.invariant_experts=grouped: each expert's rows through the
# invariant product, the routed 4-bit experts dequantised every step), beside inv_26b_bnb4's invariant job
# (the default, triton) in the same call
run ab_inv_26b_bnb4_experts 570 bash -c 'sweep ab_inv_26b_bnb4_experts experiment=rl_batch_26b_a4b quant=bnb4 \
  engine.batch_invariant=true kernels.invariant_experts=grouped'

# the invariant 4-bit experts' decoded blocks shared by four 16-row tiles at prefill-sized steps
# (kernels.invariant_4bit_subtiles), the default first; its bits: invariant_tests_moe (bnb4_lora, bnb4_one_tile)
run ab_inv_26b_bnb4_subtiles 570 bash -c 'sweep ab_inv_26b_bnb4_subtiles experiment=rl_batch_26b_a4b quant=bnb4 \
  engine.batch_invariant=true kernels.invariant_4bit_subtiles=4,1'
# the invariant 4-bit experts' scale on the products (16-row tiles always) or on the codes (prefill through bf16
# slots in step-sized tiles): kernels.invariant_4bit_scale
run invariant_tests_scale 300 python3 -m pytest -q -p no:logging -m gpu --durations=0 -k scaled_weights \
  tests/model/test_moe_kernel.py tests/engine/test_invariant.py
run ab_inv_26b_bnb4_scale 570 bash -c 'sweep ab_inv_26b_bnb4_scale experiment=rl_batch_26b_a4b quant=bnb4 \
  engine.batch_invariant=true kernels.invariant_4bit_scale=products,weights'

# A/B of the kernels keys RESULTS.md measured, the default first, in one call (same machine)
# kernels.prefill_page_check: the prefill mask_mod's page check by page table or by page owner, on each preset
# of PAGE_CHECK_PRESETS (the page table first)
run ab_prefill_page_check 570 bash -c 'for preset in ${PAGE_CHECK_PRESETS:-rl_batch_e2b}; do sweep ab_prefill_page_check_$preset \
  experiment=$preset kernels.prefill_page_check=table,owner; done'
# prefill steps of fresh chunks through FlashAttention (varlen) on the head_dim-256 layers against flex over pages
run ab_prefill_attention 570 bash -c 'for preset in ${PREFILL_PRESETS:-rl_batch_e2b}; do sweep ab_prefill_attention_$preset \
  experiment=$preset kernels.prefill_attention=flex,varlen; done'
# what sampling costs against greedy (the rl_batch presets are greedy; a GRPO rollout samples at temperature 1)
run ab_temperature 570 bash -c 'for preset in ${TEMP_PRESETS:-rl_batch_e2b}; do sweep ab_temperature_$preset \
  experiment=$preset workload.temperature=0.0,1.0; done'
run ab_31b_full_blocks 570 bash -c 'sweep ab_31b_full_blocks experiment=rl_batch_31b kernels.prefill_full_blocks=true,false'
run ab_31b_fused_kv 570 bash -c 'sweep ab_31b_fused_kv experiment=rl_batch_31b kernels.fused_kv_write=true,false'
run ab_31b_bnb4_dequant 570 bash -c 'sweep ab_31b_bnb4_dequant experiment=rl_batch_31b quant=bnb4 \
  workload.num_prompts=128 kernels.linear4bit_dequant=triton,bnb'
run ab_26b_sort 570 bash -c 'sweep ab_26b_sort experiment=rl_batch_26b_a4b kernels.moe_sort_above=512,0'
run ab_26b_bnb4_slots 570 bash -c 'sweep ab_26b_bnb4_slots experiment=rl_batch_26b_a4b quant=bnb4 \
  kernels.moe_fused_max_entries=2048,512'
# the fused 4-bit expert kernels with each block's bytes loaded a step ahead (kernels.moe_4bit_prefetch; other
# rounding) against not, the default mode's 128-row round; then the invariant mode, where only one-tile loops
# prefetch: the default (four-tile prefill loop, no prefetch) against one-tile loops that prefetch
run ab_26b_bnb4_prefetch 570 bash -c 'sweep ab_26b_bnb4_prefetch experiment=rl_batch_26b_a4b quant=bnb4 \
  kernels.moe_4bit_prefetch=false,true'
run ab_inv_26b_bnb4_prefetch 570 bash -c 'sweep ab_inv_26b_bnb4_prefetch experiment=rl_batch_26b_a4b quant=bnb4 \
  engine.batch_invariant=true kernels.invariant_4bit_subtiles=4,1'
run ab_26b_bnb4_lookup 570 bash -c 'sweep ab_26b_bnb4_lookup experiment=rl_batch_26b_a4b quant=bnb4 \
  kernels.moe_code_lookup=table,prmt'
run ab_inv_26b_bnb4_lookup 570 bash -c 'sweep ab_inv_26b_bnb4_lookup experiment=rl_batch_26b_a4b quant=bnb4 \
  engine.batch_invariant=true kernels.moe_code_lookup=table,prmt'
run ab_26b_bnb4_dequant 570 bash -c 'sweep ab_26b_bnb4_dequant experiment=rl_batch_26b_a4b quant=bnb4 \
  kernels.moe_dequant=bnb,triton'
# any other sweep: SWEEP="experiment=... key=a,b ..."
run sweep 570 bash -c "sweep sweep ${SWEEP:-experiment=block_sweep}"

# prefix caching on a GRPO-shaped rollout (docs/prefix-caching.md): each prompt prefilled once, or not
run prefix_e2b 570 bash -c 'sweep prefix_e2b experiment=grpo_rollout kv.prefix_cache=true,false'
run prefix_26b 570 bash -c 'sweep prefix_26b model=26b_a4b experiment=grpo_rollout workload.num_prompts=16 \
  engine.max_batch_size=128 workload.rounds=1 kv.prefix_cache=true,false'

# GRPO through TRL (issue 17): one job a stage (build + 10-12 steps, 2-5 min each); the table of every
# finished job is printed after each stage (experiments/grpo_gpu.py --collect)
export TRL_EXPERIMENTAL_SILENCE=1
grpo_job() {  # name steps (GRPO_STEPS=N: every job of the call N steps)
  python3 experiments/grpo_gpu.py --only "$1" --steps "${GRPO_STEPS:-$2}" --out "$WORK/grpo"
  python3 experiments/grpo_gpu.py --collect "$WORK"/grpo/*/ --out "$WORK/grpo_table" | tail -6
}
export -f grpo_job
# where the exact jobs' engine and trainer part (experiments/exact_gap.py: score, alone, trainer, prefix, graphs)
run exact_gap_e2b 300 python3 experiments/exact_gap.py +model=e2b lora=r32 device=cuda --micro 16
run exact_gap_26b 400 python3 experiments/exact_gap.py +model=26b_a4b quant=bnb4 lora=r16 device=cuda --prompts 4 --micro 8
# where the trainer's time goes with its engine forward (issue 35): checkpointed, kept, each kernels.trainer_* key
# against their references alone and both (the A/B of those keys, one process), transformers; profiles of engine
# and engine_reference
run profile_trainer_e2b 300 python3 experiments/profile_trainer.py +model=e2b lora=r32 device=cuda --micro 16
# the same step as one micro-batch of 64: what a micro-batch costs beside its tokens
run profile_trainer_e2b_mb64 240 python3 experiments/profile_trainer.py +model=e2b lora=r32 device=cuda --micro 64 \
  --skip engine_keep,engine_eager_glue,engine_float32,transformers --profile engine,engine_torch_recompute
run profile_trainer_26b 400 python3 experiments/profile_trainer.py +model=26b_a4b quant=bnb4 lora=r16 device=cuda \
  --prompts 4 --micro 8 --rounds 2 --skip engine_keep,engine_eager_glue,engine_float32,engine_torch_recompute
# the same step in micro-batches of 16 (the grpo_26b_a4b preset): beside profile_trainer_26b, what a 26B-A4B
# micro-batch costs beside its tokens (~2 s on the H100: train 8.9 s in four, 4.6 in two)
run profile_trainer_26b_mb16 300 python3 experiments/profile_trainer.py +model=26b_a4b quant=bnb4 lora=r16 \
  device=cuda --prompts 4 --micro 16 --rounds 2 --profile engine \
  --skip engine_keep,engine_eager_glue,engine_float32,engine_torch_recompute,engine_reference,transformers
run grpo_e2b 300 bash -c 'grpo_job e2b_flexgemma 12'
run grpo_e2b_exact 300 bash -c 'grpo_job e2b_exact 10'
run grpo_e2b_exact_separate 300 bash -c 'grpo_job e2b_exact_separate 10'
run grpo_e2b_exact_keep 300 bash -c 'grpo_job e2b_exact_keep 10'
run grpo_e2b_exact_keep8 300 bash -c 'grpo_job e2b_exact_keep8 10'
run grpo_e2b_exact_reference 300 bash -c 'grpo_job e2b_exact_reference 10'
run grpo_e2b_exact_mb64 300 bash -c 'grpo_job e2b_exact_mb64 10'
run grpo_e2b_exact_reference_mb64 300 bash -c 'grpo_job e2b_exact_reference_mb64 10'
run grpo_e2b_exact_mb64_torch_recompute 300 bash -c 'grpo_job e2b_exact_mb64_torch_recompute 10'
run grpo_e2b_exact_mb64_pointers 300 bash -c 'grpo_job e2b_exact_mb64_pointers 10'
run grpo_26b_exact 450 bash -c 'grpo_job 26b_bnb4_exact 5'
run grpo_26b_exact_reference 450 bash -c 'grpo_job 26b_bnb4_exact_reference 5'
run grpo_26b_exact_mb32 450 bash -c 'grpo_job 26b_bnb4_exact_mb32 5'
# the same with the engine's KV cache given back while the trainer computes (task.engine_sleep; issue 35: 20 GiB)
run grpo_26b_exact_sleep 450 bash -c 'grpo_job 26b_bnb4_exact_sleep 5'
# and as one micro-batch of 32 (fewer passes over the 4-bit experts, more activations)
run grpo_26b_exact_mb32_sleep 450 bash -c 'grpo_job 26b_bnb4_exact_mb32_sleep 5'
run grpo_26b_exact_mb16_sleep 450 bash -c 'grpo_job 26b_bnb4_exact_mb16_sleep 5'
run grpo_e2b_trl 330 bash -c 'grpo_job e2b_trl 12'
run grpo_26b 450 bash -c 'grpo_job 26b_bnb4_flexgemma 10'
run grpo_tests 240 python3 -m pytest -q -p no:logging -m gpu -s tests/rl/test_grpo.py tests/engine/test_engine_safety.py tests/engine/test_api.py
# issue 22: E2B + LoRA r32 GRPO on 2 GPUs (torchrun, one engine per rank) vs 1, the same per-GPU batch
# (8 prompts x 8 a GPU): step time, rollout tok/s (target >= 1.8x), adapters equal on both ranks every
# step (ranks.jsonl). Needs a machine with 2 GPUs (nvidia-h200-x2).
grpo_2gpu() {
  local common="+model=e2b lora=r32 task=grpo logger=none task.steps=6 task.num_generations=8 task.max_new_tokens=256
    task.learning_rate=1e-5 task.micro_batch=16 task.reward.high=32771 workload.num_prompts=64"
  CUDA_VISIBLE_DEVICES=0 python3 -m flexgemma $common task.prompts_per_step=8 hydra.run.dir="$WORK/grpo_1gpu" \
    > "$WORK/grpo_1gpu.log" 2>&1 || { tail -30 "$WORK/grpo_1gpu.log"; return 1; }
  CUDA_VISIBLE_DEVICES=0,1 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m flexgemma $common \
    task.prompts_per_step=16 hydra.run.dir="$WORK/grpo_2gpu" > "$WORK/grpo_2gpu_run.log" 2>&1 \
    || { tail -30 "$WORK/grpo_2gpu_run.log"; return 1; }
  python3 - "$WORK" <<'PY'
import json, sys
w = sys.argv[1]
one, two = (json.load(open(f"{w}/{d}/summary.json")) for d in ("grpo_1gpu", "grpo_2gpu"))
steps = [json.loads(l) for l in open(f"{w}/grpo_2gpu/ranks.jsonl")]
equal = all(len(set(s["adapter_sha256"])) == 1 for s in steps)
for k in ("grpo/step_s_median", "grpo/rollout_s_median", "grpo/rollout_tok_s_median", "grpo/logprob_absdiff_mean"):
    print(f"GRPO 2gpu {k}: 1 GPU {one[k]:.4g}  2 GPUs {two[k]:.4g}  ratio {two[k] / one[k]:.3f}")
print(f"GRPO 2gpu adapters equal on both ranks after all {len(steps)} steps: {equal}; status {one['status']}/{two['status']}")
sys.exit(0 if equal else 1)
PY
}
export -f grpo_2gpu
run grpo_2gpu 570 bash -c grpo_2gpu

# profilers: a decode step by kernel (graph replay at ROWS rows, CONTEXT tokens); the flex decode
# options per layer type timed alone (it prints the best as overrides: try them with the `sweep`
# stage); a whole round with the host's and the GPU's time per step, and a prefill step's kernels
# TEMPERATURE=1: the sampling graph (a GRPO rollout's noise over the vocabulary) instead of the all-greedy one
run profile_decode 240 python3 experiments/profile_decode.py +model=$MODEL +experiment=rl_batch_$MODEL \
  ${QUANT:+quant=$QUANT} ${LORA:+lora=$LORA} engine.max_batch_size=$ROWS cudagraph.buckets=[$ROWS] --batch $ROWS --context $CONTEXT \
  ${TEMPERATURE:+--temperature $TEMPERATURE} --out "$WORK/profile_decode.json"
# the same decode step with engine.batch_invariant=false, then true (issue 34: which kernels the invariant mode
# pays for), e.g. MODEL=26b_a4b ROWS=128 QUANT=bnb4 (LORA=r16 ROWS=32: a GRPO rollout's decode step)
run profile_decode_inv 420 bash -c "for inv in false true; do python3 experiments/profile_decode.py +model=$MODEL \
  +experiment=rl_batch_$MODEL ${QUANT:+quant=$QUANT} ${LORA:+lora=$LORA} engine.batch_invariant=\$inv engine.max_batch_size=$ROWS \
  cudagraph.buckets=[$ROWS] --batch $ROWS --context $CONTEXT --out $WORK/profile_decode_inv_\$inv.json; done"
# a prefill step's kernels with engine.batch_invariant=false, then true (issue 34: where the invariant prefill's
# time goes), e.g. MODEL=26b_a4b ROWS=128 QUANT=bnb4
run profile_prefill_inv 420 bash -c "for inv in false true; do python3 experiments/profile_generate.py --model $MODEL \
  --batch $ROWS --new-tokens 16 --profile-prefill ${QUANT:+quant=$QUANT} engine.batch_invariant=\$inv \
  --out $WORK/profile_prefill_inv_\$inv.json; done"
# flex prefill on MODEL's packed prompts under each kernels.prefill_page_check, the layer types timed alone
run profile_prefill_masks 300 python3 experiments/profile_decode.py +model=$MODEL +experiment=rl_batch_$MODEL \
  engine.max_batch_size=$ROWS cudagraph.buckets=[$ROWS] --batch $ROWS --context $CONTEXT --prefill-page-checks \
  --out "$WORK/profile_prefill_masks.json"
# which kernels give a row the same bits whatever its batch (experiments/probe_invariance.py), e.g. PROBE=moe_tiles
run probe 300 python3 experiments/probe_invariance.py ${PROBE:-}
run decode_sweep 400 python3 experiments/profile_decode.py +model=$MODEL +experiment=rl_batch_$MODEL \
  engine.max_batch_size=$ROWS cudagraph.buckets=[$ROWS] --batch $ROWS --context $CONTEXT --sweep \
  --out "$WORK/decode_sweep.json"
run profile_round 300 python3 experiments/profile_generate.py --model $MODEL --batch $ROWS --profile-prefill \
  --out "$WORK/profile_round.json"
# the kernels alone on their tile grids (each option checked against the reference first)
run bench_kernels 400 bash -c 'python3 experiments/bench_moe_kernel.py --batch-sizes 8,64,128 --bnb4 \
  --grid-batch-sizes 0 --out "$WORK/bench_moe_kernel.json"; python3 experiments/bench_linear4bit.py \
  --batch-sizes 8,64,128 --grid-batch-sizes 0 --out "$WORK/bench_linear4bit.json"; python3 experiments/bench_dequant4bit.py \
  --out "$WORK/bench_dequant4bit.json"; python3 experiments/bench_sampler.py --rows 64,256 --out "$WORK/bench_sampler.json"'
# one 26B-A4B bnb4 layer's gate_up projection at decode sizes: the fused 4-bit kernel against the same
# bytes read alone and against products on the CUDA cores (issue 39: ~0.4 TB/s at 128 rows)
run bench_4bit_forms 300 python3 experiments/bench_4bit_forms.py --batch-sizes ${BATCHES_4BIT:-8,32,128} \
  --forms "${FORMS_4BIT:-dot,dot_pf,dot_prmt}" --block-n ${BLOCK_N_4BIT:-32,64,128} --warps ${WARPS_4BIT:-4,8} \
  --out "$WORK/bench_4bit_forms.json"
# the same projection's production loop with one part swapped at a time (the code lookup: table, pair table, none,
# or prmt in registers (flexgemma/model/ptx_lookup.py); the products; the row loads): where its time goes
run ablate_4bit 300 python3 experiments/bench_4bit_forms.py --ablate --batch-sizes 8,32,128 --out "$WORK/ablate_4bit.json"
# Nsight Compute on the fused 4-bit up kernel at 32 rows, without and with kernels.moe_4bit_prefetch: stall
# reasons and per-instruction stall samples (the report and its source pages as CSV come back in $OUT)
ncu_4bit_up() {
  local ncu=/usr/local/cuda/bin/ncu
  $ncu -k regex:_routed_up_kernel -c 2 --section WarpStateStats --section SourceCounters --section SpeedOfLight \
    --import-source yes -f -o "$OUT/up32" python3 experiments/ncu_4bit_up.py || return 1
  $ncu --import "$OUT/up32.ncu-rep" --page details > "$WORK/ncu_4bit_up_details.txt"
  $ncu --import "$OUT/up32.ncu-rep" --page source --csv --print-source sass > "$OUT/up32_sass.csv"
  $ncu --import "$OUT/up32.ncu-rep" --page source --csv --print-source cuda > "$OUT/up32_source.csv"
  grep -E "Duration|Memory Throughput|Warp Cycles Per Issued|Stall|stall" "$WORK/ncu_4bit_up_details.txt" | head -40
}
export -f ncu_4bit_up
run ncu_4bit_up 200 bash -c ncu_4bit_up
# the E2B speed workload at a base commit (a copy in .old/, carried with the call) and on this tree,
# one after the other in one call: the before/after of a change
run speed_old_new 420 bash -c '(cd .old && PYTHONPATH=/tmp/site:$PWD job speed_old experiment=speed_e2b);
  job speed_new experiment=speed_e2b'
