#!/usr/bin/env bash
# Compare trainguard's NVML GPU collector with nvidia-smi on a real GPU (a few minutes at most).
#
# From a plain checkout on a GPU machine:
#     bash bench/gpu_check.sh            # 5 comparison rounds under load, then one NCCL training step
#     bash bench/gpu_check.sh --quick    # 3 rounds, shorter training timeout
#     bash bench/gpu_check.sh --no-train # NVML comparison only
#
# Needs the NVIDIA driver (nvidia-smi, libnvidia-ml.so.1) and python3 (3.11 preferred).
# Python environment, first that works:
#   1. $PYTHON, if set;
#   2. .venv/bin/python, if it imports pynvml and prometheus_client;
#   3. python3 (or python3.11/3.12) itself, if it imports both (GPU images often ship them with a CUDA torch);
#   4. a new .venv made here, then only the missing packages installed:
#        python3 -m venv --system-site-packages .venv
#        .venv/bin/pip install nvidia-ml-py prometheus-client torch
#      --system-site-packages lets a machine's preinstalled CUDA torch serve. Offline machines: point pip
#      at a wheel folder with PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels.
# torch with CUDA is optional: with it, a bf16 matmul loop loads every GPU while readings are compared;
# without it the GPUs are compared idle and the training step is skipped or fails (reported, not fatal).
#
# Output: a table per GPU and field (nvidia-smi value, collector value, median delta, tolerance,
# PASS/FAIL; tolerances: util ±10 pts, memory ±64 MiB, temperature ±3 C, power ±15% (at least 5 W),
# SM clock ±10%, throttle reasons equal), end-to-end checks (pid attribution, Prometheus export),
# the training step's result, and a last line
#     RESULT fields_ok=N fields_total=M fields_ok_ratio=R train_step=ok|failed|skipped
# Exit code 0 when every field passed.
set -uo pipefail
cd "$(dirname "$0")/.."

say() { printf '[gpu_check] %s\n' "$*"; }
fail() {
  say "ERROR $1"
  echo "RESULT fields_ok=0 fields_total=0 train_step=skipped"
  exit 1
}

command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found. HINT run this on a machine with the NVIDIA driver"
nvidia-smi -L || fail "nvidia-smi cannot talk to the driver. HINT check the driver and /dev/nvidia* access"

ok_env() { "$1" -c 'import pynvml, prometheus_client' >/dev/null 2>&1; }

PY=""
READY=""
for cand in python3 python3.11 python3.12; do
  if command -v "$cand" >/dev/null 2>&1 && ok_env "$cand"; then
    READY=$(command -v "$cand")
    break
  fi
done
BASE=$(command -v python3.11 || command -v python3 || true)
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ] && ok_env .venv/bin/python; then
  PY=.venv/bin/python
elif [ -n "$READY" ]; then
  PY=$READY
else
  [ -n "$BASE" ] || fail "no python3 found"
  if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $BASE (system site-packages visible, for a preinstalled torch)"
    "$BASE" -m venv --system-site-packages .venv || fail "python3 -m venv failed. HINT apt-get install python3-venv"
  fi
  PKGS=""
  .venv/bin/python -c 'import pynvml' >/dev/null 2>&1 || PKGS="$PKGS nvidia-ml-py"
  .venv/bin/python -c 'import prometheus_client' >/dev/null 2>&1 || PKGS="$PKGS prometheus-client"
  .venv/bin/python -c 'import torch' >/dev/null 2>&1 || PKGS="$PKGS torch"
  if [ -n "$PKGS" ]; then
    say ".venv/bin/pip install$PKGS"
    # shellcheck disable=SC2086
    .venv/bin/pip install -q --retries 1 --timeout 20 $PKGS || say "pip install failed (offline?); going on with what is there"
  fi
  ok_env .venv/bin/python || fail "no python with nvidia-ml-py and prometheus-client. HINT set PYTHON, or PIP_FIND_LINKS to a wheel folder"
  PY=.venv/bin/python
fi
say "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
# find_spec, not import: torch takes seconds to import and the helper probes CUDA in a child anyway
"$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)' ||
  say "torch not installed: GPUs are compared idle, no training step"

LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 600 "$PY" bench/gpu_check.py "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
# The RESULT line must be last even if the helper died before printing it.
if ! tail -n 1 "$LOG" | grep -q '^RESULT '; then
  say "ERROR bench/gpu_check.py ended with rc=$rc before its RESULT line"
  echo "RESULT fields_ok=0 fields_total=0 train_step=skipped"
  exit 1
fi
exit "$rc"
