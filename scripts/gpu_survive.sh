#!/usr/bin/env bash
# replace_replica's survive bench (issue 39) on a GPU machine's 16 cores, which a 2-core dev or CI
# machine cannot give it: there the figures owe part of their stall and lost throughput to the
# ranks sharing two cores with Ray, Ray Train and the warm processes.
#
#   make gpu-ray                  here (with PyPI): build/gpu-ray/site.tar.xz, Ray & co. for cp312
#   scripts/gpu_survive.sh        there, with build/gpu-ray/site.tar.xz carried beside the checkout
#
# Runs bench/recovery.py's survive mode twice on a local Ray of all the machine's cores (CPU ranks:
# two replicas cannot share one GPU, NCCL refuses two ranks on one device): the SMALL job with a
# kill every 30 s (the issue's definition of throughput_kept), then the MEDIUM job (steps ~10x
# longer) with a kill every 15 s, for the stall against a longer step. Sized for the H200
# machine's cores, slower per thread than a dev machine's (2026-11-27: SMALL ~19.5 ms a step,
# MEDIUM ~0.3 s): each job runs twice (uninterrupted, then with kills), ~4 + ~3 min in all,
# each under its own limit;
# the JSON lines go to $OUT (or runs/gpu-survive/): survive-small.jsonl, survive-medium.jsonl,
# and everything printed to survive.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-runs/gpu-survive}"
BUNDLE="${GPU_RAY_BUNDLE:-build/gpu-ray/site.tar.xz}"
SITE="${GPU_RAY_SITE:-/tmp/elastron-ray-site}"
PY="${PYTHON:-python3}"
mkdir -p "$OUTDIR" "$SITE"
LOG="$OUTDIR/survive.log"
: >"$LOG"
[[ -f "$BUNDLE" ]] || { echo "no $BUNDLE: run 'make gpu-ray' on a machine with PyPI and carry it" | tee -a "$LOG"; exit 2; }
tar -xJf "$BUNDLE" -C "$SITE" || exit 2
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
"$PY" -c 'import ray, torchft, pydantic, torch, ray.train.v2.torch, workers.trainer; print("ray", ray.__version__, "torch", torch.__version__, "cores", len(__import__("os").sched_getaffinity(0)))' 2>&1 | tee -a "$LOG"
[[ ${PIPESTATUS[0]} -eq 0 ]] || exit 2
CORES=$(nproc)
FAILED=0
# survive NAME LIMIT_S ARGS...: one bench run under a limit; its JSON lines into NAME.jsonl.
survive() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$PY" bench/recovery.py --skip recovery --skip overhead \
        --skip snapshot_overhead --skip storage_faults --ray-cpus "$CORES" "$@" 2>&1 | tee -a "$LOG" \
        | grep '^{"bench"' >"$OUTDIR/$name.jsonl"
    if [[ ${PIPESTATUS[0]} -ne 0 ]]; then
        FAILED=1
        echo "!! $name failed" | tee -a "$LOG"
        # A bench killed at its limit leaves its local Ray behind (on the loaned machine: no
        # other Ray there), which would take the next run's cores.
        pkill -9 -f 'ray::|raylet|gcs_server|dashboard' 2>/dev/null
    fi
    return 0
}
survive survive-small "${GPU_SURVIVE_SMALL_LIMIT:-280}" --survive-job small --kill-every "${GPU_SURVIVE_SMALL_KILL_EVERY:-30}" \
    --survive-iters "${GPU_SURVIVE_SMALL_ITERS:-5000}"
# GPU_SURVIVE_MEDIUM_ITERS=0: the SMALL job alone (a short loan).
[[ ${GPU_SURVIVE_MEDIUM_ITERS:-250} -gt 0 ]] && survive survive-medium "${GPU_SURVIVE_MEDIUM_LIMIT:-240}" --survive-job medium --kill-every "${GPU_SURVIVE_MEDIUM_KILL_EVERY:-15}" \
    --survive-iters "${GPU_SURVIVE_MEDIUM_ITERS:-250}"
exit $FAILED
