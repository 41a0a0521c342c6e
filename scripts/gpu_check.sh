#!/usr/bin/env bash
# The GPU path, checked in one command (issue 30): at most 8 minutes on one H100/H200.
#
#   scripts/gpu_check.sh          on the GPU machine, with build/gpu-wheels beside the checkout
#                                 (`make gpu-wheels` here, then carry it along)
#   scripts/gpu_check.sh --cpu    every step with tiny sizes on this CPU (CI runs it, so the
#                                 script cannot rot between GPU loans)
#
# Results go to $OUT (the device tool's folder) or runs/gpu-check/: check.log (everything
# printed), versions.json, steps.jsonl (one line per step: exit code, seconds), correctness.json,
# mfu.jsonl (bench/gpu_mfu.py), summary.json. Every step runs under its own time limit and the
# script goes on after a failure, so one broken step still leaves the others' figures; the exit
# code is 1 when any step failed.
#
# The GPU image's python3 has torch (2.11 + CUDA) but no pydantic: a venv with
# --system-site-packages takes the image's packages and the carried wheels are installed into it
# with --no-index. The image's python3 is itself a venv, whose packages a child venv's
# --system-site-packages would not see, so a .pth file adds the parent's site-packages too.
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=gpu
[[ "${1:-}" == "--cpu" ]] && MODE=cpu
OUTDIR="${OUT:-runs/gpu-check}"
WHEELS="${GPU_WHEELS:-build/gpu-wheels}"
mkdir -p "$OUTDIR"
LOG="$OUTDIR/check.log"
STEPS="$OUTDIR/steps.jsonl"
: >"$LOG"
: >"$STEPS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
FAILED=0

say() { echo "[gpu-check] $*" | tee -a "$LOG"; }

# step NAME LIMIT_S CMD...: run CMD under a time limit, its output into the log, its exit code
# and duration into steps.jsonl.
step() {
    local name=$1 limit=$2 start rc
    shift 2
    say "== $name (limit ${limit}s): $*"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    printf '{"step": "%s", "rc": %d, "seconds": %d}\n' "$name" "$rc" "$(($(date +%s) - start))" >>"$STEPS"
    if [[ $rc -ne 0 ]]; then
        FAILED=1
        say "!! $name failed (exit $rc)"
    fi
    return 0
}

if [[ $MODE == gpu ]]; then
    BASE_PY="${PYTHON:-python3}"
    VENV="${GPU_CHECK_VENV:-/tmp/elastron-gpu-venv}"
    if [[ ! -d "$WHEELS" ]] || ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        say "no wheels in $WHEELS: run 'make gpu-wheels' on a machine with PyPI and carry $WHEELS"
        exit 2
    fi
    say "venv $VENV (--system-site-packages, from $BASE_PY) + $(ls "$WHEELS"/*.whl | wc -l) wheels, --no-index"
    rm -rf "$VENV"
    "$BASE_PY" -m venv --system-site-packages --without-pip "$VENV" 2>&1 | tee -a "$LOG"
    SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$BASE_PY" -c 'import site, sys; print("\n".join(site.getsitepackages()))' >"$SITE/elastron_parent_site.pth"
    "$BASE_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl 2>&1 | tee -a "$LOG"
    PY="$VENV/bin/python"
    if ! "$PY" -c 'import torch, pydantic, engine.jobspec' 2>&1 | tee -a "$LOG"; then
        say "the venv cannot import torch, pydantic and the job spec: see above"
        exit 2
    fi
    # 3b at micro batch 1 fits an H100's 80 GB (72 GiB peak); on an H200 `--micro-batch 2` (90 GiB)
    # is the faster setting (docs/performance.md). fp8 is compared compiled: its eager casts cost
    # more than its GEMMs save.
    MFU_ARGS=(--sizes 1b,3b --compile --fp8 --fp8-compile --fp8-steps 50 --timeout 150)
    # A shorter loan can name fewer runs, e.g. GPU_CHECK_MFU_ARGS="--sizes 1b,3b --compile-sizes 3b --compile".
    [[ -n "${GPU_CHECK_MFU_ARGS:-}" ]] && read -r -a MFU_ARGS <<<"$GPU_CHECK_MFU_ARGS --timeout 150"
    LIMITS=(60 240 120 330)
    CUDA_TESTS=()
else
    PY="${PYTHON:-.venv/bin/python}"
    MFU_ARGS=(--smoke --timeout 120)  # the bench's own tiny CPU run: every run it makes on a GPU
    LIMITS=(60 240 120 240)
    # The CUDA tests that run on a CPU too run in the test suite already (20 s of CI for the
    # compiled one): here the step only has to show that the command and its marker still work.
    CUDA_TESTS=(-k "not test_compiled_layers_train_like_eager")
fi

step versions "${LIMITS[0]}" bash -c "'$PY' scripts/gpu_versions.py | tee '$OUTDIR/versions.json'"
step pytest-cuda "${LIMITS[1]}" "$PY" -m pytest -q -rA -m cuda -p no:cacheprovider ${CUDA_TESTS[@]+"${CUDA_TESTS[@]}"} tests/engine/test_cuda.py
step correctness "${LIMITS[2]}" "$PY" scripts/gpu_correctness.py --out "$OUTDIR/correctness.json"
rm -f "$OUTDIR/mfu.jsonl"
step mfu "${LIMITS[3]}" "$PY" bench/gpu_mfu.py "${MFU_ARGS[@]}" --out "$OUTDIR/mfu.jsonl"

"$PY" - "$OUTDIR" "$MODE" <<'EOF' | tee -a "$LOG"
import json, sys
from pathlib import Path
out, mode = Path(sys.argv[1]), sys.argv[2]
def lines(name):
    p = out / name
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []
steps = lines("steps.jsonl")
summary = {
    "mode": mode,
    "ok": bool(steps) and all(s["rc"] == 0 for s in steps),
    "steps": steps,
    "versions": (lines("versions.json") or [None])[-1],
    "correctness": (lines("correctness.json") or [None])[-1],
    "mfu": [{k: r.get(k) for k in ("size", "run", "tokens_per_s", "tflops_per_s", "mfu", "engine_over_reference",
                                   "over_eager", "speedup_over_bf16", "loss_diff_last", "memory_peak_gib", "error", "skipped")}
            for r in lines("mfu.jsonl")],
}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary))
EOF
say "done: $([[ $FAILED == 0 ]] && echo ok || echo 'some steps failed') -> $OUTDIR"
exit $FAILED
