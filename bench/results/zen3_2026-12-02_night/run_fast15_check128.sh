#!/bin/bash
# The ablation of the candidate's KL lever: the same cuts but ppo.kl.budget_check_responses at the shipped 128, on
# seed 3 (whose kept policy read 6.47 on the test queries with 64) and seed 2 (the candidate's weakest gold).
cd /work/main
D=bench/results/zen3_2026-12-02_night
export PATH=/work/main/.venv/bin:$PATH
flops() { python -c "import sys; sys.path.insert(0,'bench'); from common import measured_matmul_flops; print(round(measured_matmul_flops()/1e9))"; }
for s in 3 2; do
  echo "$(date -u +%T) check128 seed $s before: $(flops) GFLOP/s" >> $D/fast15_times.txt
  /usr/bin/time -v dvc exp run --temp -n seed-$s-fast15-check128 -S seed=$s \
    -S data.preferences.num_labels=768 -S data.preferences.num_test_labels=160 \
    -S reward.normalize.eval_samples=128 > $D/seed_${s}_fast15_check128.log 2>&1
  echo "$(date -u +%T) check128 seed $s done rc=$?" >> $D/fast15_times.txt
done
echo "$(date -u +%T) after: $(flops) GFLOP/s" >> $D/fast15_times.txt
