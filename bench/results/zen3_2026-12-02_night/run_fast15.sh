#!/bin/bash
# Five whole-pipeline seeds of a default cut to fit 15 minutes on the Zen 3 (issue 50, point 2): one at a time, alone.
cd /work/main
D=bench/results/zen3_2026-12-02_night
export PATH=/work/main/.venv/bin:$PATH
flops() { python -c "import sys; sys.path.insert(0,'bench'); from common import measured_matmul_flops; print(round(measured_matmul_flops()/1e9))"; }
for s in 1 2 3 4 5; do
  echo "$(date -u +%T) seed $s before: $(flops) GFLOP/s" >> $D/fast15_times.txt
  /usr/bin/time -v dvc exp run --temp -n seed-$s-fast15 -S seed=$s \
    -S data.preferences.num_labels=768 -S data.preferences.num_test_labels=160 \
    -S ppo.kl.budget_check_responses=64 -S reward.normalize.eval_samples=128 > $D/seed_${s}_fast15.log 2>&1
  echo "$(date -u +%T) seed $s done rc=$?" >> $D/fast15_times.txt
done
echo "$(date -u +%T) after: $(flops) GFLOP/s" >> $D/fast15_times.txt
