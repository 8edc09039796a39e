#!/usr/bin/env bash
# A base image for the Dockerfile where none can be pulled: Debian bookworm built with debootstrap,
# Python 3.11 in a virtual environment at /opt/venv first on PATH (so `python` and `pip` are the
# Dockerfile's), imported into podman (or docker) as localhost/debian-python:3.11.
#
#   sudo docker/debian_base.sh [TAG] [MIRROR]
#   docker/build_and_check.sh localhost/debian-python:3.11
set -euo pipefail
TAG=${1:-localhost/debian-python:3.11}
MIRROR=${2:-http://deb.debian.org/debian}
ENGINE=${ENGINE:-podman}
ROOTFS=$(mktemp -d /tmp/debian-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$ROOTFS" "$MIRROR"
chroot "$ROOTFS" python3 -m venv /opt/venv
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | $ENGINE import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' - "$TAG"
echo "built $TAG"
