#!/usr/bin/env bash
# Everything that needs the GPU, in one call of the device tool (device time is scarce):
# the GPU tests, then the benchmarks, each under its own time limit, logs and JSON into $OUT.
#   bash experiments/gpu_suite.sh [tests] [e2b] [e2b_twice] [e2b_async] [profile] [e4b] [31b] [moe] [moe32] [bnb4]
# (default: all, ~35 min: more than one device call may hold; pick names, e.g. `tests e2b e2b_async`)
# Expects the wheels of `../shared/device/fetch-wheels --with-wandb submitit==1.5.4 hydra-submitit-launcher==1.2.0`
# in .whl/ (carried with the call: run(carry=[".whl"])); wandb is optional there (without it the
# jobs warn and go on), submitit only matters for `-m` sweeps.
set -u
OUT=${OUT:-/tmp/flexgemma_gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
ARGS=" $* "
run() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  if [ "$ARGS" != "  " ] && [[ "$ARGS" != *" $name "* ]]; then return; fi
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 ))s"
  grep -E "passed|failed|^FAILED|Error:|tok_s_median|speedup|peak_allocated|build_seconds|capture_seconds" "$OUT/$name.log" \
    | grep -v DEBUG | tail -12
}
bench=experiments/bench_vs_hf.py
# the GPU tests: three pytest processes at once (they are correctness checks, not timings; the card
# and 16 cores hold them side by side), each with its own log
gpu_tests() {
  local pids=() f
  for f in "gpu tests/test_gpu.py" "moe_quant tests/test_moe.py tests/test_quant.py" "lora tests/test_lora_gpu.py"; do
    set -- $f
    local name=$1; shift
    timeout 270 python3 -m pytest -q -p no:logging -m gpu --durations=0 "$@" > "$OUT/tests_$name.log" 2>&1 &
    pids+=($!)
  done
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  cat "$OUT"/tests_*.log
  return $rc
}
export -f gpu_tests
export OUT
run tests 290 bash -c gpu_tests
run e2b 240 python3 $bench +model=e2b +experiment=speed_e2b --hf-rounds 1 --out "$OUT/e2b.json"
run e2b_twice 150 python3 $bench +model=e2b +experiment=speed_e2b --no-hf --out "$OUT/e2b_again.json"
run e2b_async 150 python3 $bench +model=e2b +experiment=speed_e2b engine.async_decode=true --no-hf \
  --out "$OUT/e2b_async.json"
run profile 120 python3 experiments/profile_decode.py +model=e2b +experiment=speed_e2b cudagraph.buckets=[64] \
  --batch 64 --context 544 --out "$OUT/profile.json"
run e4b 240 python3 $bench +model=e4b +experiment=speed_e2b --hf-rounds 1 --out "$OUT/e4b.json"
run 31b 300 python3 $bench +model=31b +experiment=speed_e2b workload.num_prompts=32 engine.max_batch_size=32 \
  kv.max_pages=520 cudagraph=ladder16 --hf-rounds 1 --out "$OUT/31b.json"
run moe 300 python3 $bench +model=26b_a4b +experiment=speed_26b_a4b workload.num_prompts=8 --hf-rounds 1 \
  --out "$OUT/26b_bs8.json"
run moe32 240 python3 $bench +model=26b_a4b +experiment=speed_26b_a4b workload.num_prompts=32 --no-hf \
  --out "$OUT/26b_bs32.json"
run bnb4 400 python3 experiments/bench_bnb4.py --cases 26b_bs8,26b_bs32,e2b --bf16 --out "$OUT/bnb4.json"
