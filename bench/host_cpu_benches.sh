#!/bin/bash
# The CPU benchmarks on a many-core host (a lent GPU machine's Intel CPU, say) in one call: PPO's three sides
# (shared, separate, TRL) at once, each pinned to 2 physical cores of its own at 2 torch threads under the
# portable numerics `make bench` uses, then the reward-model bench on the shared side's cores once it is done.
# The ratios come from separate processes: read them off the three reports (s/update), and note that once a
# side ends, those still running have the memory system more to themselves.
#
#   bash bench/host_cpu_benches.sh [MODEL] [UPDATES] [RM_STEPS]    (smollm2-random 3 16); LIMIT=555 s a process
#   on a device host with .gpu/ from ../shared/gpu/make_kit.sh plus trl's wheel in .gpu/whl (carry [".gpu"]);
#   NUMERICS=native runs every side with the CPU's own kernels (AVX-512 on such a host; default portable)
#   RM=0 leaves out the reward bench, RM=only runs it alone (on an Intel host, ~6.6 s a step ours and
#   ~10 s TRL's: 16 steps a side need ~330 s, more than is left after the PPO sides in one call)
#   RM_PROFILE=1 adds --profile to the reward bench (one more step a side, under torch's profiler)
#   TINY=1 also runs `.gpu/check.sh tiny` (the tiny pipeline on CUDA) on the cores left over, with its
#   `dvc repro` given LIMIT-55 s instead of check.sh's own 300 (beside the CPU benches its stages ran
#   1.3-1.7x slower than alone: 257 s beside the `native` PPO sides, past 300 s beside the `portable` ones)
#   a dry run here: PY3=.venv/bin/python SKIP_INSTALL=1 OUT=/tmp/out bash bench/host_cpu_benches.sh tiny 1 2
# Reports and logs: $OUT (the .md files, and results.tgz with every log: a device call brings back 8 files).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
MODEL=${1:-smollm2-random}; UPDATES=${2:-3}; RM_STEPS=${3:-16}; LIMIT=${LIMIT:-555}  # TRL's side needed 499 s on an Intel host; run with timeout_s 595
NUMERICS=${NUMERICS:-portable}; RM=${RM:-1}
FINAL=${OUT:-/tmp/out}; OUT=/tmp/host_cpu_benches; rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL"
T0=$(date +%s); log() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PY3=${PY3:-/opt/torch/.venv/bin/python3}; [ -x "$PY3" ] || PY3=$(command -v python3)
rm -rf /tmp/site2  # not check.sh's /tmp/site: that one removes and refills its own
[ -n "${SKIP_INSTALL:-}" ] || timeout 180 "$PY3" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/site2 .gpu/whl/*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site2:$(pwd)
log "installed"; grep -m1 "model name" /proc/cpuinfo; lscpu | grep -E "^(Thread|Core|Socket|CPU\(s\))"
# one logical CPU per physical core, in core order: two processes never share a core's two threads
mapfile -t CPUS < <(lscpu -p=CPU,CORE,SOCKET | grep -v '^#' | sort -t, -k3,3n -k2,2n -u | awk -F, '!seen[$2","$3]++ {print $1}')
N=${#CPUS[@]}; echo "physical cores (one logical CPU each): ${CPUS[*]}"
pair() { echo "${CPUS[$(( (2*$1) % N ))]},${CPUS[$(( (2*$1+1) % N ))]}"; }  # wraps only on a machine of < 6 cores
"$PY3" -c "import sys; sys.path.insert(0, 'bench'); from common import materialise_model; print(materialise_model('$MODEL'))"
log "model ready"  # materialised once, before the sides start: they would race to write it
run_ppo() {  # side, cores
  timeout "$LIMIT" taskset -c "$2" "$PY3" bench/ppo_throughput.py --model "$MODEL" --only "$1" --updates "$UPDATES" \
    --cpu-numerics "$NUMERICS" --markdown --output "$OUT/ppo_$1.md" > "$OUT/ppo_$1.log" 2>&1
  echo "ppo $1 on cpus $2 rc=$? at $(( $(date +%s) - T0 )) s"
}
run_rm() {  # cores
  timeout $(( LIMIT - ($(date +%s) - T0) + 20 )) taskset -c "$1" "$PY3" bench/reward_throughput.py \
    --model "$MODEL" --steps "$RM_STEPS" --cpu-numerics "$NUMERICS" ${RM_PROFILE:+--profile} --markdown --output "$OUT/rm_$NUMERICS.md" \
    > "$OUT/rm_$NUMERICS.log" 2>&1
  echo "reward bench rc=$? at $(( $(date +%s) - T0 )) s"
}
if [ "$RM" = only ]; then
  run_rm "$(pair 0)" &
else
  run_ppo trl "$(pair 0)" &
  run_ppo separate "$(pair 1)" &
  (
    run_ppo shared "$(pair 2)"
    [ "$RM" = 0 ] || run_rm "$(pair 2)"
  ) &
fi
if [ -n "${TINY:-}" ] && [ "$N" -gt 8 ]; then
  (
    REST=$(IFS=,; echo "${CPUS[*]:6}")
    # check.sh is the shared kit's, read-only: a copy whose `dvc repro` may run until this script's limit
    REPRO="timeout $(( LIMIT - 55 )) python -m dvc repro"
    sed "s/timeout 300 python -m dvc repro/$REPRO/" .gpu/check.sh > /tmp/check_tiny.sh
    grep -q "$REPRO" /tmp/check_tiny.sh || echo "check.sh changed: its repro keeps 300 s"
    OUT=$OUT/tiny PYTHONPATH= timeout "$LIMIT" taskset -c "$REST" bash /tmp/check_tiny.sh tiny > "$OUT/tiny_check.log" 2>&1
    echo "tiny check on cpus $REST rc=$? at $(( $(date +%s) - T0 )) s"
  ) &
fi
wait
for f in "$OUT"/*.log; do echo "== $f"; grep -E "update times|step times|Traceback|Error" "$f" | tail -4; done
log "end"
cp "$OUT"/*.md "$FINAL"/ 2>/dev/null; tar -czf "$FINAL/results.tgz" -C "$OUT" .; ls -la "$FINAL"
