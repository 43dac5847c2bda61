#!/usr/bin/env bash
# The peer tools of bench/recovery.py, as shipped, in a venv of their own beside the same torch
# (nvidia-resiliency-ext 0.4.1 is the newest with a Python 3.11 wheel). Idempotent.
#   bash bench/peers_venv.sh [DIR]      (default /tmp/trainguard-peers)
set -euo pipefail
dir="${1:-/tmp/trainguard-peers}"
[ -x "$dir/bin/python" ] || python3 -m venv "$dir"
"$dir/bin/pip" install -q torch==2.13.0 numpy prometheus_client "nvidia-resiliency-ext==0.4.1" "torchft==0.2.0"
echo "$dir"
