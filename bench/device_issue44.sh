#!/usr/bin/env bash
# Issue 44's device check, from the repository root of a source tree (no install):
#   python bench/hf_excerpt.py .devstub   # here; carry .devstub
#   bench/device_issue44.sh               # there: into $OUT
# 1. JAX's sparse core against dense causal attention (bench/device_sparse.py);
# 2. bench/device_linear.sh's linear section and fixture checks, for the time that is left.
set -u
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/device_issue44}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout "${SPARSE_S:-170}" python3 bench/device_sparse.py "$out/sparse_gpu.json" > "$out/sparse_gpu.log" 2>&1
echo "sparse: exit $?" > "$out/sparse_exit.txt"
OUT="$out" LINEAR_S="${LINEAR_S:-200}" MIXERS_S="${MIXERS_S:-60}" ALL_S="${ALL_S:-90}" bash bench/device_linear.sh
