#!/usr/bin/env bash
# The gated delta rule on a lent GPU, from the repository root of a source tree (no install):
#   python bench/hf_excerpt.py .devstub   # here, where transformers is installed; carry .devstub
#   bench/device_linear.sh                # there: into $OUT, else bench/results/device_linear
# 1. attn-parity bench --only linear (the FULL grid) with torch's tensors on the GPU;
# 2. attn-parity check --framework jax over the three recurrent mixers' fixtures;
# 3. attn-parity check --framework jax over every fixture, for the time that is left.
# transformers' two functions come from .devstub where the machine has no transformers.
set -u
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/device_linear}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import transformers" 2>/dev/null || export PYTHONPATH="$PYTHONPATH:$PWD/.devstub"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import jax, torch, transformers; print(jax.__version__, jax.devices(), torch.__version__, torch.version.cuda, transformers.__version__)" >> "$out/gpu.txt" 2>&1
timeout "${LINEAR_S:-260}" python3 -m golden.bench --only linear --out "$out" > "$out/linear.md" 2> "$out/linear.log"
echo "linear: exit $?" >> "$out/gpu.txt"
timeout "${MIXERS_S:-100}" python3 -m golden.cli check --framework jax --variant gated_delta_net \
  --variant kimi_delta_attention --variant lightning_attention > "$out/check_mixers.txt" 2>&1
echo "check mixers: exit $?" >> "$out/gpu.txt"
timeout "${ALL_S:-180}" python3 -m golden.cli check --framework jax > "$out/check_all.txt" 2>&1
echo "check all: exit $?" >> "$out/gpu.txt"
