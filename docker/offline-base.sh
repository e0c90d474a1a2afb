#!/usr/bin/env bash
# Builds a stand-in for python:3.11-slim from Debian's own packages, for machines that reach
# Debian's mirror and PyPI but not Docker Hub. Needs root, debootstrap and a running Docker engine.
#
#   sudo docker/offline-base.sh                    # makes the image smddp-lab/python:3.11
#   docker build -f docker/Dockerfile --build-arg BASE_IMAGE=smddp-lab/python:3.11 -t smddp-lite:cpu .
#
# Like python:3.11-slim it has python, pip and installed scripts on PATH (here from a virtual
# environment over Debian bookworm's Python 3.11, since Debian's own pip refuses system installs).
set -euo pipefail

image=${1:-smddp-lab/python:3.11}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [[ $EUID -ne 0 ]]; then
    echo "offline-base.sh: debootstrap needs root; run it with sudo" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "offline-base.sh: debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "offline-base.sh: no Docker engine answers: apt-get install docker.io, then start dockerd" >&2; exit 1; }

rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror"
# the host's trust store, so that pip inside trusts whatever TLS proxy the host's own pip goes through
cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
tar -C "$rootfs" -c . | docker import - "$image-rootfs"
docker build -t "$image" - <<DOCKERFILE
FROM $image-rootfs
RUN python3 -m venv /usr/local/python
ENV PATH=/usr/local/python/bin:\$PATH LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt
CMD ["python"]
DOCKERFILE
echo "built $image"
