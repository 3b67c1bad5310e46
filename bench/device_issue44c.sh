#!/usr/bin/env bash
# Issue 44's third device check, from the repository root of a source tree (no install), into
# $OUT: the modules' selections through the core's sparse implementation and the sparse core
# itself on the accelerator (tests/test_selection_sparse.py, tests/test_sparse_core.py: the
# JAX twin on the GPU, torch's on the CPU), then the recurrent mixers' fixtures through the JAX
# twin (what the second check's 60 s did not reach).
set -u
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/device_issue44c}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import jax, torch; print(jax.__version__, jax.devices(), torch.__version__)" > "$out/gpu.txt" 2>&1
timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_selection_sparse.py \
  tests/test_sparse_core.py > "$out/tests.txt" 2>&1
echo "tests: exit $?" >> "$out/gpu.txt"
timeout "${CHECK_S:-100}" python3 -m golden.cli check --framework jax --variant gated_delta_net \
  --variant kimi_delta_attention --variant lightning_attention > "$out/check_mixers.txt" 2>&1
echo "check mixers: exit $?" >> "$out/gpu.txt"
