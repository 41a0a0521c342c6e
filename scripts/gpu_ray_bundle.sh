#!/usr/bin/env bash
# Ray, torchft and the job spec's packages for the GPU machines, as one archive that travels with
# a device run: build/gpu-ray/site.tar.xz (run here, with PyPI; `make gpu-ray`).
#
# The GPU image has no Ray (REFERENCE.md), and Ray's cp312 wheel alone is 79 MB, over the 64 MiB
# that may travel with a run. Unpacked, most of it is Java jars, RLlib, Ray LLM and the
# dashboard's web client, which a local cluster running Ray Train does not load; without them,
# and compressed with xz, the whole set fits (the size is printed, and checked against 56 MiB so
# the checkout travels beside it). There:
#
#   mkdir -p /tmp/site && tar -xJf build/gpu-ray/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site
#
# The wheels are scripts/gpu-wheels.txt's (pydantic & co., torchao left out) and
# scripts/gpu-ray-wheels.txt's, for cp312 manylinux x86_64 with --no-deps: no torch is resolved.
# GPU_RAY_PYTHON_VERSION=3.11 builds the same set for this machine's Python, in build/gpu-ray-3.11/
# (to try the trimmed Ray here: PYTHONPATH=<unpacked> .venv/bin/python bench/recovery.py --smoke).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER="${GPU_RAY_PYTHON_VERSION:-3.12}"
OUT=build/gpu-ray
[[ $PYVER == 3.12 ]] || OUT="build/gpu-ray-$PYVER"
WHEELS="build/gpu-ray-wheels-$PYVER"  # beside, not inside: $OUT is what travels
LIMIT=$((56 * 2**20))
ARCHIVE="$OUT/site.tar.xz"
rm -rf "$OUT"
mkdir -p "$WHEELS" "$OUT/site"
grep -hv '^torchao' scripts/gpu-wheels.txt scripts/gpu-ray-wheels.txt | sed 's/#.*//' | grep -v '^\s*$' >"$OUT/requirements.txt"
PIP_CONSTRAINT= "${PYTHON:-python3}" -m pip download -q --only-binary=:all: --no-deps \
    --python-version "$PYVER" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -r "$OUT/requirements.txt" -d "$WHEELS"
# A wheel is its site-packages layout; unzip keeps the executables' mode (Ray's raylet, gcs_server).
for w in "$WHEELS"/*.whl; do unzip -q -o "$w" -d "$OUT/site"; done
# What a local Ray running Ray Train never loads. The dashboard's web client goes, but its folder
# stays (empty): the dashboard's HTTP head refuses to start without it, and the driver's API calls
# need the head.
rm -rf "$OUT"/site/ray/{jars,rllib,llm,serve/_private/benchmarks} "$OUT"/site/ray/dashboard/client/build
mkdir -p "$OUT"/site/ray/dashboard/client/build/static
find "$OUT/site" -name '__pycache__' -prune -exec rm -rf {} +
tar -C "$OUT/site" -cf - . | xz -T0 -7 >"$ARCHIVE"
rm -rf "$OUT/site"
size=$(stat -c %s "$ARCHIVE")
echo "$ARCHIVE: $size bytes ($(wc -l <"$OUT/requirements.txt") wheels, Python $PYVER)"
[[ $size -le $LIMIT ]] || { echo "$ARCHIVE is over 56 MiB"; exit 1; }
