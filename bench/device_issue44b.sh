#!/usr/bin/env bash
# Issues 43 and 44's second device check, from the repository root of a source tree (no
# install), into $OUT:
# 1. the chunked delta rule's chunk grouping on the accelerator (bench/device_grouping.py);
# 2. the JAX twin's block indexer, token indexer and recurrent mixers against their fixtures
#    (attn-parity check --framework jax);
# 3. tests/test_blocks_jax.py and tests/test_delta_rule_jax.py on the accelerator.
set -u
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/device_issue44b}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import jax, torch; print(jax.__version__, jax.devices(), torch.__version__)" >> "$out/gpu.txt" 2>&1
timeout "${GROUPING_S:-150}" python3 bench/device_grouping.py "$out/grouping.json" > "$out/grouping.log" 2>&1
echo "grouping: exit $?" >> "$out/gpu.txt"
for pick in "-k gqa_blocks" "-k mla_indexer" \
    "--variant gated_delta_net --variant kimi_delta_attention --variant lightning_attention"; do
  # shellcheck disable=SC2086
  timeout "${CHECK_S:-60}" python3 -m golden.cli check --framework jax $pick >> "$out/check.txt" 2>&1
  echo "check $pick: exit $?" >> "$out/gpu.txt"
done
timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_blocks_jax.py \
  tests/test_delta_rule_jax.py > "$out/tests.txt" 2>&1
echo "tests: exit $?" >> "$out/gpu.txt"
