"""``attn-parity device-check``: one prepared command for a lent GPU (an NVIDIA H100 or H200,
no internet, minutes of time), run from the source tree:

    PYTHONPATH=. python3 -m golden.cli device-check --out DIR     (bench/device_check.sh)

It runs three phases and writes at most eight files into DIR (docs/devices.md, "Checking a
GPU: the device command"): the JAX twin over every golden fixture on the GPU (``check``), the
accelerator tests and the GPU-only tests (``tests``), and a bfloat16 timing grid of the JAX
core's implementations against jax.nn's and torch's fused kernels, all in one process
(``timing``). One room a part, imports pointing down:

- ``plan``: what a run does, with neither JAX nor torch imported: the phases, the files, the
  timing grid and its cells, FLOPs, memory estimates and the rule that skips a cell, the
  dry-run listing, the command's options;
- ``timing``: the timing phase (``run_timing``, ``time_cell``), every cell's failure recorded,
  never raised;
- ``run``: the command (``main``): the refusal without a GPU, the phases in order, env.json.
"""

from golden.device_check.plan import add_arguments

__all__ = ["add_arguments"]
