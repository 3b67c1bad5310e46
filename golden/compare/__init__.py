"""Compare a user's PyTorch module with their Flax NNX port: ``attn-parity compare``.

``compare(torch_factory, flax_factory, mapping, inputs)`` draws weights in the torch layout and
inputs, sets the same weights in both modules through the mapping (torch state-dict key -> Flax
parameter path, with a ``golden.specification.mapping`` rule from the torch layout to the Flax one),
and runs

    torch float64       the reference: output, gradients of L = Σ output ⊙ dO for every
                        parameter and float input, outputs of the paired submodules (hooks)
    torch float32       the same, shown as the same-precision baseline (or ``dtype``)
    Flax float32        one ``nnx.jit`` program: output, gradients (mapped back to the torch
                        layout through the rule's inverse), every submodule's ``__call__``
                        output (``nnx.capture(..., method_outputs=nnx.Intermediate)``)

and judges the Flax float32 column against torch float64 with
``golden.specification.tolerances.compare``.
``dtype="bfloat16"`` or ``"float16"`` runs the baseline and the Flax module in that dtype and
judges with ``golden.specification.tolerances.compare_to_plain`` (the dtype's row, or at most 2x the
torch baseline's error). Inputs go positionally (``inputs``) and by name (``keywords``: arrays,
nested arrays, plain values, per-run factories); ``output`` selects the array judged from a tuple,
dict, ``ModelOutput`` or dataclass, the same way in both frameworks. The verdict is on the output
and the gradients; a paired submodule is a module owning a mapped parameter on each side
(``golden.specification.mapping.submodule``), and the first one in torch's execution order whose
Flax output misses the float32 value tolerance is named as where the port diverges. Both modules run
in eval mode; by default a module returning a tuple is judged on its first array, one returning a
dict or ModelOutput on its first value.

``freeze`` writes what was drawn and the float64 expectations as a port fixture (the container
of ``golden.specification.fixture``: a zip of ``.npy`` members, never pickled), and ``check_port``
checks a Flax module against such a file without torch.

The rooms, each importing only those above it:

    mappings            ``neutral``, the mapping checked against both modules, the paired
                        submodules
    calls               the drawn weights and inputs, keyword inputs, the output selection,
                        the checks of those arguments and of the dtype (``RUN_DTYPES``)
    running             the torch and the Flax run
    report              ``PortReport``: its text table and JSON (``SCHEMA``)
    localise            where the Flax run first parts from the reference
    verdict             the rows judged against torch float64, the suspects
    reference_steps     float32 steps inside the torch float64 reference, and their effect
    port_fixture        ``freeze`` and ``load_port`` (``FORMAT``, ``FORMAT_VERSION``)
    checks              ``compare`` and ``check_port``
    cli                 the ``compare`` sub-command
"""

from __future__ import annotations

from golden.compare.calls import RUN_DTYPES, per_framework
from golden.compare.checks import check_port, compare
from golden.compare.cli import add_arguments, run_cli
from golden.compare.mappings import neutral
from golden.compare.port_fixture import (FORMAT, FORMAT_VERSION, FORMAT_VERSIONS, freeze,
                                         load_port)
from golden.compare.report import SCHEMA, PortReport

__all__ = ["FORMAT", "FORMAT_VERSION", "FORMAT_VERSIONS", "RUN_DTYPES", "SCHEMA", "PortReport",
           "add_arguments", "check_port", "compare", "freeze", "load_port", "neutral",
           "per_framework", "run_cli"]
