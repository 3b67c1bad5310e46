#!/usr/bin/env bash
# attn-parity device-check on a lent GPU, from the repository root of a source tree (no install):
#   bench/device_check.sh [--dry-run] [--quick] [--only check|tests|timing] [--budget SECONDS]
# Writes into $OUT (the device machine's folder that comes back), else bench/results/device.
# docs/devices.md, "Checking a GPU: the device command", says what it runs and writes.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX and torch share the GPU in one process
exec python3 -m golden.cli device-check --out "${OUT:-bench/results/device}" "$@"
