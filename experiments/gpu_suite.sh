#!/usr/bin/env bash
# Everything that needs the GPU, stage by stage, each under its own time limit (device time is
# scarce: a call may run 10 minutes, so pick the stages of one call by name).
#   bash experiments/gpu_suite.sh STAGE...
#   sampler_tests: the compiled top-k/top-p sampler on the GPU (a quick probe before the long stages)
# Stages (in this order): sampler_tests sampler_head nosync_test batches batches_e2b batches_e2b_quick batches_26b batches_e4b batches_26b_bnb4 batches_31b batches_31b_bnb4 linear4bit_rows batches_31b_bnb4_dq linear4bit_ksteps dequant_grid batches_31b_bnb4_tdq batches_31b_bnb4_bdq attn_31b_sweep attn_31b_split kernels_large moe_slots_ab batches_26b_bnb4_slots moe_dequant_ab moe_sort_vs_match moe_block_m moe_sort_ab moe_grid_rl gen_profile_e2b profile_31b_64 prefill_full_tests e2b_parity_tests batches_31b_full_blocks decode_sweep_31b decode_tuned_31b decode_tuned_26b decode_tuned_e2b decode_tuned_e4b batches_31b_vs_defaults prefill_sweep_31b batches_31b_prefill16k fused_kv_write_31b gen_profile_31b gen_profile_26b prefix prefix_26b prefix_26b_full prefix_26b_greedy prefix_speed prefix_tests grpo_e2b grpo_e2b_trl grpo_26b grpo_tests grpo_2gpu speed_old_new tests moe_kernel_tests linear4bit_tests linear4bit_bench retest e2b e2b_quick moe moe_bs8 moe_quick moe_grouped moe_kernel_bench lora lora_bnb4 sweep profile profile_e2b_256 profile_26b_128 profile_moe profile_moe_grouped moe_bnb4 moe_bnb4_grouped 31b e4b lora_26b
# Logs and JSON go to $WORK (default /tmp/flexgemma_gpu); at the end they are packed into
# $OUT/results.tgz (the device tool brings back at most 8 files) and a digest is printed.
# Expects the wheels of `../shared/device/fetch-wheels --with-wandb submitit==1.5.4 hydra-submitit-launcher==1.2.0`
# in .whl/ (carried with the call: run(carry=[".whl"])).
set -u
OUT=${OUT:-/tmp/flexgemma_out}
WORK=${WORK:-/tmp/flexgemma_gpu}
mkdir -p "$OUT" "$WORK"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE WORK
pack() { tar czf "$OUT/results.tgz" -C "$WORK" . 2>/dev/null; }
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
  grep -E "passed|failed|^FAILED|Error:|GRPO|grpo step|e2b_|26b_|tok/s|tok_s_median|speedup|peak|parity|ratio|refresh|build_seconds|capture_seconds|best|sum over|^built |^\| |BLOCK_M|GPU per|  host |cap inside" \
    "$WORK/$name.log" | grep -v DEBUG | tail -25
  pack
}
bench=experiments/bench_vs_hf.py
# 26B-A4B cut to its first six layers (five sliding, one full) so that float32 fits beside the tests
L6="model.hf_config.num_hidden_layers=6 model.hf_config.layer_types=[sliding_attention,sliding_attention,sliding_attention,sliding_attention,sliding_attention,full_attention]"

run sampler_tests 120 python3 -m pytest -q -p no:logging -m gpu -s tests/test_sampling.py
# the decode step's tail alone: the soft-cap inside the sampler's graph vs writing float32 logits first
run sampler_head 120 python3 experiments/bench_sampler.py --rows 64,256,512 --out "$WORK/sampler_head.json"
# growing pages while a decode step is in flight does not wait for the GPU
run nosync_test 150 python3 -m pytest -q -p no:logging -m gpu -s tests/test_gpu.py -k handing_out

# RL-sized batches (issue 21): one build per variant at the largest batch (cudagraph=auto), every batch
# size in that process, no per-size warm-up round (the build's warm-up must make the first timed round
# as fast as the median); tables and JSON in $WORK/batches. E2B ~3.5 min, 26B-A4B ~3 min.
batches_e2b() {
  python3 experiments/bench_batches.py --model e2b --batch-sizes 64,128,256,512 --new-tokens 512 --rounds 3 \
    --warmup-rounds 0 --out "$WORK/batches"
}
batches_26b() {
  python3 experiments/bench_batches.py --model 26b_a4b --batch-sizes 8,64,128 --new-tokens 256 --rounds 3 \
    --warmup-rounds 0 --out "$WORK/batches"
}
export -f batches_e2b batches_26b
run batches 570 bash -c 'batches_e2b; batches_26b; cat "$WORK"/batches/*.md'
run batches_e2b 300 bash -c 'batches_e2b; cat "$WORK"/batches/bench_batches_e2b.md'
# two batch sizes of the E2B set in one short build (a call that has other stages to run)
run batches_e2b_quick 300 bash -c 'python3 experiments/bench_batches.py --model e2b --batch-sizes 64,256 --new-tokens 512 \
  --rounds 3 --warmup-rounds 0 --out "$WORK/batches"; cat "$WORK"/batches/bench_batches_e2b.md'
run batches_26b 300 bash -c 'batches_26b; cat "$WORK"/batches/bench_batches_26b_a4b.md'
# issue 21's other rows of the targets table, one build each (E4B ~3 min, 31B and the bnb4 builds ~3-4 min)
run batches_e4b 300 bash -c 'python3 experiments/bench_batches.py --model e4b --batch-sizes 64,128 --new-tokens 512 \
  --rounds 3 --warmup-rounds 0 --out "$WORK/batches"; cat "$WORK"/batches/bench_batches_e4b.md'
run batches_26b_bnb4 330 bash -c 'python3 experiments/bench_batches.py --model 26b_a4b --batch-sizes 8,128 --new-tokens 256 \
  --rounds 3 --warmup-rounds 0 --out "$WORK/batches_bnb4" quant=bnb4; cat "$WORK"/batches_bnb4/*.md'
run batches_31b 330 bash -c 'python3 experiments/bench_batches.py --model 31b --batch-sizes 32,64 --new-tokens 256 \
  --rounds 3 --warmup-rounds 0 --out "$WORK/batches"; cat "$WORK"/batches/bench_batches_31b.md'
batches_31b_bnb4() {  # extra bench_batches flags...: 31B bnb4 at 64 and 128 rows, one build
  python3 experiments/bench_batches.py --model 31b --batch-sizes 64,128 --new-tokens 256 --rounds 3 --warmup-rounds 0 \
    "$@" --out "$WORK/batches_bnb4" quant=bnb4 && cat "$WORK"/batches_bnb4/*31b*.md
}
export -f batches_31b_bnb4
run batches_31b_bnb4 330 bash -c 'batches_31b_bnb4'
# 4-bit projections at RL batch sizes (31B bnb4 ran 60 ms a step at 64 rows and 111 at 128: the kernel's
# programs of 64 rows each decode their weights again and write float32 partials): the kernel, programs of 128/256 rows, and the
# group dequantised once + one GEMM (whose cost does not grow with the rows), 31B's and E2B's groups
run linear4bit_rows 240 python3 experiments/bench_linear4bit.py --groups 31b_qkv_sliding,31b_qk_full,31b_o_sliding,31b_gate_up,31b_down,qkv_sliding,gate_up_wide,down_wide \
  --batch-sizes 16,32,64,128,256,512 --grid-batch-sizes 128,256,512 --grid-groups 31b_gate_up,31b_down,gate_up_wide \
  --out "$WORK/linear4bit_rows.json"
# 31B bnb4 with steps past N rows dequantised + one GEMM (N=32: both sizes) against the default
run batches_31b_bnb4_dq 330 bash -c 'batches_31b_bnb4 --linear4bit-max-rows ${DQ_ROWS:-32}'
# the 4-bit kernel with several K steps a program (fewer float32 partials) at decode sizes, 31B's and
# E2B's groups; the dequantise kernel beside bitsandbytes' op
run linear4bit_ksteps 240 python3 experiments/bench_linear4bit.py --groups 31b_qkv_sliding,31b_o_sliding,31b_gate_up,31b_down,qkv_sliding,gate_up_wide,down_wide \
  --batch-sizes 8,32,64,128 --grid-batch-sizes 8,32,64,128 --grid-groups 31b_gate_up,31b_down,gate_up_wide,down_wide \
  --out "$WORK/linear4bit_ksteps.json"
# the dequantise kernel's options (bytes a program, warps) on 31B's and E2B's groups, each checked bit
# for bit against bitsandbytes' op (sixth session: 3.6-4.0 TB/s on 31B's groups, the op 1.6-1.9); then
# the experts' slot kernel against a gather + bitsandbytes' op at 26B-A4B's shapes
run dequant_grid 150 python3 experiments/bench_dequant4bit.py --out "$WORK/dequant_grid.json"
# 31B bnb4 with the groups dequantised by the kernel here (the default since the sixth session) and by
# bitsandbytes' op (the same bits), one build each
run batches_31b_bnb4_tdq 330 bash -c 'batches_31b_bnb4 --linear4bit-dequant triton'
run batches_31b_bnb4_bdq 330 bash -c 'batches_31b_bnb4 --linear4bit-dequant bnb'
# 31B bf16 at 64 rows (1,770-1,791 tok/s, under its 1,800 floor): flex decode's BLOCK_N on the
# head_dim-256 sliding layers, tuned on E2B (one KV head of 8 query heads; 31B: 16 KV heads of 2).
# Sixth session: 64 1,720, 16 1,732, 32 (the default) 1,770
run attn_31b_sweep 450 bash -c 'for bn in 64 16 32; do python3 experiments/bench_batches.py --model 31b --batch-sizes 64 \
  --new-tokens 256 --rounds 3 --warmup-rounds 0 --out "$WORK/attn31b_bn$bn" attn.decode.block_n=$bn; done;
  cat "$WORK"/attn31b_bn*/*.md'
# 31B bf16 at 64 rows, flex decode's KV splits (torch's get_split_k: 132 SMs // (rows x KV heads) x 2,
# so 1 split at 64 rows for both layer types; the head_dim-512 layers then run 64 x 4 = 256 programs,
# under two a SM): the default, 4 splits on the full layers, 2 on every layer; a build each
run attn_31b_split 450 bash -c 'python3 experiments/bench_batches.py --model 31b --batch-sizes 64 --new-tokens 256 \
  --rounds 3 --warmup-rounds 0 --out "$WORK/attn31b_split_default";
  python3 experiments/bench_batches.py --model 31b --batch-sizes 64 --new-tokens 256 --rounds 3 --warmup-rounds 0 \
  --out "$WORK/attn31b_split_full4" +attn.decode.full_attention.extra.SPLIT_KV=4;
  python3 experiments/bench_batches.py --model 31b --batch-sizes 64 --new-tokens 256 --rounds 3 --warmup-rounds 0 \
  --out "$WORK/attn31b_split_all2" +attn.decode.extra.SPLIT_KV=2; cat "$WORK"/attn31b_split_*/*.md'
# the kernels past the sizes they were tuned at: 4-bit projections up to 512 rows (programs of 64 rows)
# against bitsandbytes' dequantise + GEMM, routed experts past 1,024 entries (sorted) against torch's path
run kernels_large 300 bash -c 'python3 experiments/bench_linear4bit.py --batch-sizes 64,128,256,512 \
  --grid-batch-sizes 256 --out "$WORK/linear4bit_large.json" && python3 experiments/bench_moe_kernel.py \
  --batch-sizes 64,128,256,512 --bnb4 --grid-batch-sizes 256 --out "$WORK/moe_kernel_large.json"'

# the routed 4-bit experts at 32-512 rows, decoded inside the kernels (the default up to 2,048 entries)
# against dequantised into slots by the sixth session's faster dequantise form (slots_us in the JSON),
# then 26B-A4B bnb4 at 128 rows through the engine, the default (2,048) against slots past 512 entries
run moe_slots_ab 200 python3 experiments/bench_moe_kernel.py --batch-sizes 32,64,128,256,512 --bnb4 \
  --grid-batch-sizes 0 --block-m "" --out "$WORK/moe_slots_ab.json"
run batches_26b_bnb4_slots 400 bash -c 'for f in 2048 512; do python3 experiments/bench_batches.py --model 26b_a4b \
  --batch-sizes 128 --new-tokens 256 --rounds 3 --warmup-rounds 0 --moe-fused-max-entries $f --out "$WORK/batches_bnb4" \
  quant=bnb4; done; cat "$WORK"/batches_bnb4/*fused_max*.md'
# 26B-A4B bnb4's prefill with the experts dequantised in one pass by the slot kernel (CPU-tested only)
# against bitsandbytes' op after a gather (the default): the tables' "prefill s" column, one build each
run moe_dequant_ab 330 bash -c 'for v in triton bnb; do python3 experiments/bench_batches.py --model 26b_a4b \
  --batch-sizes 128 --new-tokens 256 --rounds 3 --warmup-rounds 0 --moe-dequant $v --out "$WORK/batches_bnb4" \
  quant=bnb4; done; cat "$WORK"/batches_bnb4/*moe_dequant*.md'
# issue 21, 26B-A4B at 128 rows (1,024 entries: the matched path, each program scanning the whole
# routing): each expert program finding its entries by a sort outside vs by matching, bf16 and 4-bit
run moe_sort_vs_match 200 python3 experiments/bench_moe_kernel.py --batch-sizes 8,32,64,128,256 --bnb4 \
  --grid-batch-sizes 0 --out "$WORK/moe_sort_vs_match.json"
# entries of one expert per tile (BLOCK_M 16 / 32 / 64) at RL batch sizes, sorted and matched
run moe_block_m 200 python3 experiments/bench_moe_kernel.py --batch-sizes 64,128,256,512 --bnb4 \
  --grid-batch-sizes 0 --out "$WORK/moe_block_m.json"
# the sort threshold on the real (random-weight) router, whose load is less even than the kernel bench's
# uniform routing: 26B-A4B at 64 and 128 rows sorting every step vs the default (sort past 512 entries)
run moe_sort_ab 330 bash -c 'for a in 0 512; do python3 experiments/bench_batches.py --model 26b_a4b --batch-sizes 64,128 \
  --new-tokens 256 --rounds 3 --warmup-rounds 0 --moe-sort-above $a --out "$WORK/batches_sort"; done; cat "$WORK"/batches_sort/*.md'
# the tile grid (BLOCK_N, BLOCK_K, warps) at RL batch sizes, entries sorted, BLOCK_M as the default picks
run moe_grid_rl 200 python3 experiments/bench_moe_kernel.py --batch-sizes 128,256,512 --grid-batch-sizes 128,256,512 \
  --block-m "" --out "$WORK/moe_grid_rl.json"
# a whole round at an RL batch with timers: the GPU's busy time per decode step, its idle gaps
# between steps, and the host's per-step work (is the engine host-bound at 256 rows?)
run gen_profile_e2b 200 python3 experiments/profile_generate.py --model e2b --batch 256 --new-tokens 512 \
  --out "$WORK/gen_profile_e2b.json"
# 31B bf16's decode step at 64 rows by kernel (27.6 ms against 17.9 for its bytes at 4.8 TB/s; the bf16
# GEMMs alone ~15 ms): how much is attention over 24.5 GB of KV, how much glue
run profile_31b_64 200 python3 experiments/profile_decode.py +model=31b +experiment=rl_batch_31b \
  cudagraph.buckets=[64] --batch 64 --context 416 --out "$WORK/profile_31b_64.json"
# prefill masks with full blocks (the kernel skips the mask_mod on pages a query block passes wholly):
# E2B float32 through flex against transformers (prompts of 7/130/600 tokens: full blocks on both
# layer types), then 31B bf16 at 64 with and without them, one build each
run prefill_full_tests 200 python3 -m pytest -q -p no:logging -m gpu -s tests/test_gpu.py -k full_blocks
# E2B bf16 and float32 (flex, dense) against transformers, a float32 divergence judged by transformers in
# float64 (2026-12-02: the 200 s above did not hold all three builds)
run e2b_parity_tests 420 python3 -m pytest -q -p no:logging -m gpu -s tests/test_gpu.py -k e2b_eager
run batches_31b_full_blocks 330 bash -c 'for f in 1 0; do python3 experiments/bench_batches.py --model 31b \
  --batch-sizes 64 --new-tokens 256 --rounds 3 --warmup-rounds 0 --prefill-full-blocks $f \
  --out "$WORK/batches_full_blocks"; done; cat "$WORK"/batches_full_blocks/*.md'
# 31B bf16 at 64, 0.3% under its floor after the full blocks (2026-12-02): flex kernel options per layer
# type timed alone, decode (64 rows at 416 tokens) and prefill (one packed 8,192-token chunk of the
# workload's prompts); then the round with prefill chunks of 16,384 tokens (2 steps instead of 3)
run decode_sweep_31b 400 python3 experiments/profile_decode.py +model=31b +experiment=rl_batch_31b \
  cudagraph.buckets=[64] --batch 64 --context 416 --sweep --out "$WORK/decode_sweep_31b.json"
# flex decode options per model (issue 21): the sweep at the workload's rows and mean context (each
# option in a CUDA graph; the preset's own options first), then the preset against the preset with the
# sweep's best where it beats the preset's by over 2%, a build each. Every preset now carries its run's
# winners (2026-12-02: 31B 1,778 -> 1,874, 26B-A4B 5,146 -> 5,305, E2B 29,141 -> 32,209, E4B 12,705 ->
# 14,300 tok/s), so a rerun checks them against the sweep again.
decode_tuned() {  # model rows context new-tokens [overrides...]
  local m=$1 b=$2 c=$3 n=$4; shift 4
  python3 experiments/profile_decode.py +model=$m +experiment=rl_batch_$m engine.max_batch_size=$b cudagraph.buckets=[$b] \
    "$@" --batch $b --context $c --sweep --out "$WORK/decode_sweep_$m.json" > "$WORK/decode_sweep_$m.log" 2>&1
  grep -E "^decode |Error" "$WORK/decode_sweep_$m.log" | tail -6
  local ov; ov=$(sed -n "s/^decode overrides: //p" "$WORK/decode_sweep_$m.log")
  if [[ -z "$ov" ]]; then echo "$m: no decode options beat the preset's by 2%"; return 0; fi
  for d in preset tuned; do
    python3 experiments/bench_batches.py --model $m --batch-sizes $b --new-tokens $n --rounds 3 --warmup-rounds 0 \
      --out "$WORK/decode_tuned_$m/$d" "$@" $([[ $d == tuned ]] && echo "$ov")
  done
  cat "$WORK"/decode_tuned_$m/*/*.md
}
export -f decode_tuned
run decode_tuned_31b 590 bash -c 'decode_tuned 31b 64 416 256'
run decode_tuned_26b 590 bash -c 'decode_tuned 26b_a4b 128 416 256'
run decode_tuned_e2b 590 bash -c 'decode_tuned e2b 256 544 512'
run decode_tuned_e4b 590 bash -c 'decode_tuned e4b 128 544 512'
# 31B bf16 at 64: its preset (tuned decode options, fused K/V write) against the engine's defaults
run batches_31b_vs_defaults 330 bash -c 'for d in preset defaults; do python3 experiments/bench_batches.py --model 31b \
  --batch-sizes 64 --new-tokens 256 --rounds 3 --warmup-rounds 0 --out "$WORK/batches_31b_$d" \
  $([[ $d == defaults ]] && echo attn.decode.block_n=32 attn.decode.num_warps=null attn.decode.num_stages=null \
  kernels.fused_kv_write=false); done; cat "$WORK"/batches_31b_*/*.md'
run prefill_sweep_31b 400 python3 experiments/profile_decode.py +model=31b +experiment=rl_batch_31b \
  cudagraph.buckets=[64] --batch 64 --context 416 --prefill-sweep --out "$WORK/prefill_sweep_31b.json"
run batches_31b_prefill16k 330 bash -c 'for n in 16384 8192; do python3 experiments/bench_batches.py --model 31b \
  --batch-sizes 64 --new-tokens 256 --rounds 3 --warmup-rounds 0 --out "$WORK/batches_prefill_$n" \
  engine.max_prefill_tokens=$n; done; cat "$WORK"/batches_prefill_*/*.md'
# the K/V norms and the pool write as one compiled function (attention.FUSED_KV_WRITE; CPU-tested
# only, 2026-12-02): its GPU test, then 31B bf16 at 64 with and without it, one build each
run fused_kv_write_31b 420 bash -c 'python3 -m pytest -q -p no:logging -m gpu -s tests/test_gpu.py -k fused_kv_write;
  for f in 1 0; do python3 experiments/bench_batches.py --model 31b --batch-sizes 64 --new-tokens 256 --rounds 3 \
  --warmup-rounds 0 --fused-kv-write $f --out "$WORK/batches_fused_kv"; done; cat "$WORK"/batches_fused_kv/*.md'
# 31B bf16 at 64 (issue 21's one floor not met): the round's prefill/decode split, the host's gaps, a prefill step's kernels
run gen_profile_31b 240 python3 experiments/profile_generate.py --model 31b --batch 64 --new-tokens 256 --profile-prefill \
  --out "$WORK/gen_profile_31b.json"
run gen_profile_26b 200 python3 experiments/profile_generate.py --model 26b_a4b --batch 128 --new-tokens 256 \
  --out "$WORK/gen_profile_26b.json"

# issue 18, prefix caching: +experiment=grpo_rollout (32 prompts x n=8, 1,024-2,048 + 512 tokens) with
# kv.prefix_cache=true then false, one job each (~2-4.5 min a pair), and the speed workload (no shared
# prompts) with and without; each job prints its summary's throughput, prompt-KV peak and prefix metrics
prefix_job() {  # name overrides...
  local name=$1; shift
  python3 -m flexgemma "$@" logger=none hydra.run.dir="$WORK/$name" > "$WORK/$name.job.log" 2>&1 \
    || { echo "$name failed:"; tail -5 "$WORK/$name.job.log"; return 1; }
  python3 - "$WORK/$name/summary.json" "$name" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
words = ("tok_s_median", "kv_in_use_peak", "prefill_tokens_computed", "prefix_hit", "shared_pages_peak",
         "preemptions", "kv_prompt_peak", "peak_allocated", "run_to_run", "round_seconds_median", "gpu_idle",
         "decode_gpu_step")
print(sys.argv[2], {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items() if any(w in k for w in words)})
PY
}
prefix_grpo() {  # model overrides...: sharing on, then off, then their tokens side by side
  local model=$1; shift
  prefix_job "prefix_${model}_on" +model="$model" +experiment=grpo_rollout kv.prefix_cache=true "$@"
  prefix_job "prefix_${model}_off" +model="$model" +experiment=grpo_rollout kv.prefix_cache=false "$@"
  python3 - "$WORK/prefix_${model}_on" "$WORK/prefix_${model}_off" <<'PY'
import json, sys
on, off = ([json.loads(l) for l in open(f"{d}/completions.jsonl")] for d in sys.argv[1:])
diff = [(a["prompt_index"], a["sample"], next(i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y))
        for a, b in zip(on, off) if a["token_ids"] != b["token_ids"]]
print(f"prefix tokens on vs off: {len(on) - len(diff)}/{len(on)} identical; differ (prompt, sample, first token): {diff[:20]}")
PY
}
export -f prefix_job prefix_grpo
run prefix 570 bash -c 'prefix_grpo e2b'
run prefix_26b 570 bash -c 'prefix_grpo 26b_a4b workload.num_prompts=16 engine.max_batch_size=128 workload.rounds=1'
# the preset's own size on 26B-A4B: 32 prompts x 8 = 256 sequences at once (unshared, their KV is ~65 GB)
run prefix_26b_full 570 bash -c 'prefix_grpo 26b_a4b workload.rounds=1'
# the 26B copies that differed (sampled) in the first run: greedy, logprobs in the summaries
run prefix_26b_greedy 570 bash -c 'prefix_grpo 26b_a4b workload.num_prompts=16 engine.max_batch_size=128 workload.rounds=1 workload.temperature=0'
run prefix_speed 450 bash -c 'for pc in true false; do prefix_job speed_prefix_$pc +model=e2b +experiment=speed_e2b \
  workload.rounds=3 kv.prefix_cache=$pc; done'
run prefix_tests 360 python3 -m pytest -q -p no:logging -m gpu -s tests/test_prefix_cache.py

# GRPO through TRL (issue 17): one job a stage (build + 10-12 steps, 2-5 min each); the table of every
# finished job is printed after each stage (experiments/grpo_gpu.py --collect)
export TRL_EXPERIMENTAL_SILENCE=1
grpo_job() {  # name steps
  python3 experiments/grpo_gpu.py --only "$1" --steps "$2" --out "$WORK/grpo"
  python3 experiments/grpo_gpu.py --collect "$WORK"/grpo/*/ --out "$WORK/grpo_table" | tail -6
}
export -f grpo_job
run grpo_e2b 300 bash -c 'grpo_job e2b_flexgemma 12'
run grpo_e2b_trl 330 bash -c 'grpo_job e2b_trl 12'
run grpo_26b 450 bash -c 'grpo_job 26b_bnb4_flexgemma 10'
run grpo_tests 240 python3 -m pytest -q -p no:logging -m gpu -s tests/test_grpo.py tests/test_engine_safety.py tests/test_api.py
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
# issue 15's speed check: the same E2B workload at the session's base commit (a copy in .old/, carried)
# and on this tree, one after the other in one call
speed_old_new() {
  (cd .old && python3 experiments/bench_vs_hf.py +model=e2b +experiment=speed_e2b workload.rounds=5 --no-hf \
     --out "$WORK/e2b_old.json" > "$WORK/e2b_old.log" 2>&1)
  python3 experiments/bench_vs_hf.py +model=e2b +experiment=speed_e2b workload.rounds=5 --no-hf \
     --out "$WORK/e2b_new.json" > "$WORK/e2b_new.log" 2>&1
  grep -hE "tok_s_median|tok/s" "$WORK/e2b_old.log" | tail -3; echo "-- new"; grep -hE "tok_s_median|tok/s" "$WORK/e2b_new.log" | tail -3
}
export -f speed_old_new
run speed_old_new 330 bash -c speed_old_new

# correctness, not timings: the GPU test files and the float32 26B-A4B parity job side by side
gpu_tests() {
  local pids=() f
  for f in "gpu tests/test_gpu.py" "moe_quant tests/test_moe.py tests/test_quant.py" "lora tests/test_lora_gpu.py"; do
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
run moe_kernel_tests 150 python3 -m pytest -q -p no:logging -m gpu --durations=0 -s tests/test_moe_kernel.py
run linear4bit_tests 150 python3 -m pytest -q -p no:logging -m gpu --durations=0 -s tests/test_linear4bit.py
run linear4bit_bench 180 python3 experiments/bench_linear4bit.py --batch-sizes 8,32,64 --out "$WORK/linear4bit_bench.json"
# the tests that failed on the last run, side by side
retest() {
  timeout 300 python3 -m pytest -q -p no:logging -s -m gpu tests/test_gpu.py -k e2b_eager > "$WORK/retest_e2b.log" 2>&1 &
  local a=$!
  timeout 300 python3 -m pytest -q -p no:logging -s -m gpu tests/test_quant.py -k cli_job > "$WORK/retest_bnb4.log" 2>&1 &
  local b=$! rc=0
  wait $a || rc=1
  wait $b || rc=1
  grep -hE "passed|failed|^FAILED|^E  .{0,200}$|divergence|peak_allocated" "$WORK"/retest_*.log | head -30
  return $rc
}
export -f retest
run retest 300 bash -c retest
run e2b 240 python3 $bench +model=e2b +experiment=speed_e2b --both-loops --hf-rounds 1 --out "$WORK/e2b.json"
run e2b_quick 150 python3 $bench +model=e2b +experiment=speed_e2b workload.rounds=3 --no-hf --out "$WORK/e2b_quick.json"
run moe 330 python3 $bench +model=26b_a4b +experiment=speed_26b_a4b workload.num_prompts=64 --batch-sizes 8,16,32,64 \
  --hf-batch-sizes 8 --hf-rounds 1 --parity 4 --parity-tokens 32 --out "$WORK/moe.json"
# the issue's batch-8 figure (936) came from an 8-sequence build: graphs and pool for 8
run moe_bs8 150 python3 $bench +model=26b_a4b +experiment=speed_26b_a4b workload.num_prompts=8 engine.max_batch_size=8 \
  --batch-sizes 8 --no-hf --out "$WORK/moe_bs8.json"
run moe_quick 200 python3 $bench +model=26b_a4b +experiment=speed_26b_a4b workload.num_prompts=64 --batch-sizes 8,16,32,64 \
  --no-hf --out "$WORK/moe_quick.json"
run moe_grouped 300 python3 $bench +model=26b_a4b +experiment=speed_26b_a4b workload.num_prompts=64 \
  kernels.moe=grouped_mm --batch-sizes 8,16,32,64 --no-hf --parity 4 --parity-tokens 32 --out "$WORK/moe_grouped.json"
run moe_kernel_bench 150 python3 experiments/bench_moe_kernel.py --batch-sizes 8,32,64 --bnb4 --grid-quants bnb4 --out "$WORK/moe_kernel_bench.json"
run lora 200 python3 experiments/bench_lora.py +model=e2b +experiment=speed_e2b workload.rounds=3 lora=r32 --out "$WORK/lora_e2b.json"
# two bnb4 engines (build, Triton compiles, capture) and 3 timed rounds each: 124 s with 2 rounds and
# the Triton groups (session 6), over 171 s before their shapes became runtime arguments
run lora_bnb4 330 python3 experiments/bench_lora.py +model=e2b +experiment=speed_e2b workload.rounds=3 quant=bnb4 lora=r32 \
  --out "$WORK/lora_e2b_bnb4.json"
run sweep 300 bash -c 'python3 -m flexgemma -m +model=e2b +experiment=block_sweep attn.decode.block_n=32,64 \
  attn.decode.full_attention.block_n=16,32 attn.decode.num_warps=null attn.decode.num_stages=null \
  cudagraph.buckets=[64] workload.rounds=2 logger=none \
  hydra.sweep.dir="$WORK/sweep" && python3 -m flexgemma.report "$WORK/sweep"'
run profile 120 python3 experiments/profile_decode.py +model=e2b +experiment=speed_e2b cudagraph.buckets=[64] \
  --batch 64 --context 544 --out "$WORK/profile.json"
# issue 21: where an RL-sized decode step goes (graph replay at the preset's batch, greedy as the preset)
run profile_e2b_256 150 python3 experiments/profile_decode.py +model=e2b +experiment=rl_batch_e2b \
  cudagraph.buckets=[256] --batch 256 --context 544 --out "$WORK/profile_e2b_256.json"
run profile_26b_128 200 python3 experiments/profile_decode.py +model=26b_a4b +experiment=rl_batch_26b_a4b \
  cudagraph.buckets=[128] --batch 128 --context 500 --out "$WORK/profile_26b_128.json"
run profile_moe 150 python3 experiments/profile_decode.py +model=26b_a4b +experiment=speed_26b_a4b \
  workload.num_prompts=8 engine.max_batch_size=8 cudagraph.buckets=[8] --batch 8 --context 384 --out "$WORK/profile_moe.json"
run profile_moe_grouped 150 python3 experiments/profile_decode.py +model=26b_a4b +experiment=speed_26b_a4b \
  kernels.moe=grouped_mm workload.num_prompts=8 engine.max_batch_size=8 cudagraph.buckets=[8] --batch 8 --context 384 --out "$WORK/profile_moe_grouped.json"
run moe_bnb4 240 python3 $bench +model=26b_a4b +experiment=speed_26b_a4b quant=bnb4 workload.num_prompts=32 \
  engine.max_batch_size=32 --batch-sizes 8,32 --no-hf --out "$WORK/moe_bnb4.json"
run moe_bnb4_grouped 240 python3 $bench +model=26b_a4b +experiment=speed_26b_a4b quant=bnb4 kernels.moe=grouped_mm \
  workload.num_prompts=32 engine.max_batch_size=32 --batch-sizes 8,32 --no-hf --out "$WORK/moe_bnb4_grouped.json"
run 31b 240 python3 $bench +model=31b +experiment=speed_e2b workload.num_prompts=32 engine.max_batch_size=32 \
  kv.max_pages=520 cudagraph=ladder16 workload.rounds=2 workload.max_new_tokens=256 --no-hf --out "$WORK/31b.json"
run e4b 180 python3 $bench +model=e4b +experiment=speed_e2b workload.rounds=3 --no-hf --out "$WORK/e4b.json"
run lora_26b 240 python3 experiments/bench_lora.py +model=26b_a4b +experiment=speed_26b_a4b workload.num_prompts=32 \
  engine.max_batch_size=32 lora=r32 --skip-base --refresh-iters 5 --out "$WORK/lora_26b.json"
