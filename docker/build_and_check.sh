#!/usr/bin/env bash
# Build the Dockerfile, then run the tiny profile's whole pipeline inside the image (not CI).
#
#   docker/build_and_check.sh [BASE_IMAGE]     # default: the Dockerfile's python:3.11-slim
#   WHEELS=/opt/wheels docker/build_and_check.sh ...   # torch from a local wheel folder
#   CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt ...   # pip behind a TLS-intercepting proxy
#
# The pipeline runs as a build step of an image FROM the one just built (`podman build
# --isolation=chroot`), so the check needs no `podman run` (blocked in some VMs): it is the
# image's own filesystem and interpreter that run every stage (each stage imports the project's own
# rlhf_pipeline, the files dvc.lock hashes; the `rlhf` command runs the non-editable install).
# ENGINE=docker works too. Where no base image can be pulled, make one with docker/debian_base.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${ENGINE:-podman}
BASE=${1:-python:3.11-slim}
ISOLATION=()
if [ "$ENGINE" = podman ]; then ISOLATION=(--isolation=chroot --format docker); fi

# WHEELS=/dir: a folder holding the torch wheel, for hosts that cannot reach the torch index
WHEEL_ARGS=()
if [ -n "${WHEELS:-}" ]; then
    WHEEL_ARGS=(-v "$WHEELS:$WHEELS:ro" --build-arg "PIP_FIND_LINKS=$WHEELS"
        --build-arg "TORCH_INDEX_URL=https://pypi.org/simple")
fi
# CA_BUNDLE=/file: the host's CA bundle, for pip behind a TLS-intercepting proxy
if [ -n "${CA_BUNDLE:-}" ]; then
    WHEEL_ARGS+=(-v "$CA_BUNDLE:/etc/ssl/host-ca.crt:ro" --build-arg "PIP_CERT=/etc/ssl/host-ca.crt")
fi

$ENGINE build "${ISOLATION[@]}" "${WHEEL_ARGS[@]}" --build-arg "BASE_IMAGE=$BASE" -t rlhf-pipeline .

CHECK=$(mktemp -d)
trap 'rm -rf "$CHECK"' EXIT
cat > "$CHECK/Containerfile" <<'CONTAINERFILE'
FROM rlhf-pipeline
# DVC's cache is a volume at run time; a build step writes it inside the layer instead
RUN python -c "import rlhf_pipeline, sys; print('rlhf_pipeline from', rlhf_pipeline.__file__)" \
    && rlhf profile tiny \
    && dvc repro \
    && dvc status \
    && dvc metrics show \
    && rlhf lineage models/policy \
    && python -c "from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained('models/policy'); assert t.padding_side == 'left', t.padding_side; print('policy tokenizer pads', t.padding_side)"
CONTAINERFILE
$ENGINE build "${ISOLATION[@]}" -f "$CHECK/Containerfile" -t rlhf-pipeline-check "$CHECK"
echo "ok: every stage of the tiny profile ran inside rlhf-pipeline"
