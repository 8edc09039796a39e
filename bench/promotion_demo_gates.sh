#!/usr/bin/env bash
# The promotion-gate demo on the CPU default (bench/results/promotion_demo.md): round 1 registers the committed
# default run as v1; round 2 is every label inverted, through the retrain flow (its gate: VADER, as shipped);
# then the same v2 is judged again by three gates, each in a clone where v2 is not yet registered: no judge
# (proxy), a frozen judge trained on 256 golden labels, and people side by side (simulated people).
# Usage: bash bench/promotion_demo_gates.sh  (from the project root, after `make setup` and a committed `dvc repro`)
set -euxo pipefail
PROJECT=$(pwd)
export PATH="$PROJECT/.venv/bin":$PATH HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p /tmp/d51 && rm -rf /tmp/d51/demo /tmp/d51/judge
git clone -q "$PROJECT" /tmp/d51/demo && cd /tmp/d51/demo
git config user.email demo@example.com && git config user.name demo
dvc cache dir --local "$PROJECT/.dvc/cache" && dvc checkout -q

dvc status
time rlhf models gate                                    # round 1: v1 against the base
python bench/promotion_demo_inverted_labels.py /tmp/d51/inverted.jsonl --golden /tmp/d51/golden.jsonl
git rev-parse HEAD > /tmp/d51/v1_commit
# the judge: a scratch clone trains a reward model on the golden set alone
git clone -q /tmp/d51/demo /tmp/d51/judge && cd /tmp/d51/judge
dvc cache dir --local "$PROJECT/.dvc/cache" && dvc checkout -q
cp /tmp/d51/golden.jsonl data/labels/golden.jsonl
python - <<'PY'
import yaml
p = yaml.safe_load(open("params.yaml"))
p["data"]["preferences"]["source"] = "data/labels/golden.jsonl"
yaml.safe_dump(p, open("params.yaml", "w"), sort_keys=False)
PY
time dvc repro train_reward
cat metrics/reward_train.json
# the round of inverted labels through the retrain flow (its gate: vader, as shipped)
cd /tmp/d51/demo
python - <<'PY'
import yaml
p = yaml.safe_load(open("params.yaml"))
p["data"]["preferences"]["source"] = "data/labels/round2.jsonl"
p["labelling"]["source"] = "file"
yaml.safe_dump(p, open("params.yaml", "w"), sort_keys=False)
PY
git commit -qam "demo: labels come from a file (data/labels/round2.jsonl)"
time python -m flows.retrain --incoming /tmp/d51/inverted.jsonl --no-push
rlhf models
for way in proxy frozen human; do
  rm -rf /tmp/d51/$way && git clone -q /tmp/d51/demo /tmp/d51/$way && cd /tmp/d51/$way
  git config user.email demo@example.com && git config user.name demo
  dvc cache dir --local "$PROJECT/.dvc/cache" && dvc checkout -q
  git tag -d policy@v2.0.0 reward-model@v2.0.0

done
cd /tmp/d51/proxy
python - <<'PY'
import yaml
p = yaml.safe_load(open("params.yaml")); p["promotion"].update(score="proxy", judge=None)
yaml.safe_dump(p, open("params.yaml", "w"), sort_keys=False)
PY
git commit -qam "demo: no judge, the proxy gate" && time rlhf models gate
cd /tmp/d51/frozen
mkdir -p data/models && cp -r /tmp/d51/judge/models/reward_unnormalized data/models/judge && cp /tmp/d51/golden.jsonl data/labels/golden.jsonl
python - <<'PY'
import yaml
p = yaml.safe_load(open("params.yaml")); p["promotion"].update(score="gold", judge="data/models/judge", golden_labels="data/labels/golden.jsonl")
yaml.safe_dump(p, open("params.yaml", "w"), sort_keys=False)
PY
git add params.yaml data/labels/golden.jsonl && git commit -qm "demo: a frozen judge trained on 256 golden labels" && time rlhf models gate
cd /tmp/d51/human
python - <<'PY'
import yaml
p = yaml.safe_load(open("params.yaml")); p["promotion"].update(score="human", judge=None)
yaml.safe_dump(p, open("params.yaml", "w"), sort_keys=False)
PY
git commit -qam "demo: people judge side by side" && time rlhf models gate
time rlhf label compare policy@v2 policy#prod tasks.json
python bench/promotion_demo_simulated_people.py tasks.json export.json
rlhf label verdicts export.json
time rlhf models gate
