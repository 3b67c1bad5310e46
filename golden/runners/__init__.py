"""Fixture runners: each runs a golden fixture through one implementation.

The runner contract, public: any callable ``run_fixture(fixture, dtype) -> dict`` (``fixture`` a
``golden.Fixture``, ``dtype`` one of its ``dtypes``) is an implementation that
``attn-parity check --impl package.module:callable`` can judge. The dict holds
    "output"              float64 NumPy array of the fixture's expected output shape (required)
    "weights"             (optional) float64 array of the attention weights' shape
    "grads"               (optional) {name: float64 array}: dL/d(name) for every float input and
                          every parameter (neutral layout) of the fixture's loss
                          L = Σ output ⊙ cotangents/output + Σ weights ⊙ cotangents/weights
    "loss"                (optional) "output" when the gradients are of Σ output ⊙ dO alone (an
                          implementation that returns no weights); default "both"
    "dtype"               the dtype the computation ran in
    "core"                (optional) which named implementation(s) of the core ran
                          (golden.specification.implementations: "explicit", "fused", ...), as
                          recorded
What a result holds is what gets checked: a forward-only runner (torch's fused kernel, a NumPy
port) returns no "grads". A runner that cannot run a fixture raises
``golden.runners.adapt.NotSupported`` with the reason (a runner of ``golden.runners.adapt``,
which ``check --impl`` wraps every implementation in, takes a ``NotImplementedError`` for one);
any other exception is a failure.
A module variant is built from the fixture's parameters cast to ``dtype``, in training mode when
the fixture holds a dropout mask and in eval mode otherwise. ``golden.runners.adapt``
builds runners from a plain function or a module class in one line.

This is the harness layer: it imports torch and JAX, but only when their runner is asked for, so
an installation with one framework runs that framework's fixtures.
"""

from __future__ import annotations

import contextlib
import importlib

import numpy as np

from golden import reference

FRAMEWORKS = ("reference", "torch", "jax")
_MODULES = {"torch": "golden.runners.torch_runner", "jax": "golden.runners.jax_runner"}


def run_reference(fixture, dtype="float64", *, weights_cotangent=True, exact=True) -> dict:
    """Recompute the fixture from its stored inputs with the reference, as the fixture stores
    it (``exact``: golden.reference.exact_arithmetic, then rounded once to float64; the same
    bits on every machine), or with ``exact=False`` in NumPy float64 (fast; the last bits
    depend on the CPU). Without ``weights_cotangent``, the gradients are of Σ output ⊙ dO
    alone. A recurrent mixer's result has no "weights"; latent attention with an indexer's
    has "key_indices" (int32), the keys it chose."""
    inputs = {n: (a.astype(np.float64) if a.dtype.kind == "f" else a)
              for n, a in fixture.inputs.items()}
    forward, backward = reference.pair(fixture.variant)
    cot = {n: a.astype(np.float64) for n, a in fixture.cotangents.items()}
    if not weights_cotangent and "weights" in cot:
        cot["weights"] = np.zeros_like(cot["weights"])
    with reference.exact_arithmetic() if exact else contextlib.nullcontext():
        out, weights, saved = forward(fixture.config, inputs, fixture.params)
        grads = backward(saved, cot["output"], cot.get("weights"))
    out, weights, grads, _ = reference.stored(fixture.config, out, weights, grads)
    result = {"output": out, "weights": weights, "dtype": "float64", "grads": grads}
    if reference.selected_keys(saved) is not None:  # the keys a learned indexer chose
        result["key_indices"] = reference.selected_keys(saved)
    if weights is None:  # a recurrent mixer: no attention weights
        del result["weights"]
    return result


def refuses(framework, core, fixture) -> str | None:
    """Why ``framework``'s core implementation ``core`` cannot run the fixture (the twin's own
    rule, from its registry), or None."""
    return _module(framework).refuses(core, fixture)


def get(framework, core=None):
    """The ``run_fixture`` of "reference", "torch" or "jax" (``core="fused"``: torch's
    forward-only ``run_fused``); ImportError naming the missing framework and the extra that
    installs it."""
    if framework == "reference":
        return run_reference
    module = _module(framework)
    return module.run_fused if core == "fused" else module.run_fixture


def _module(framework):
    if framework not in _MODULES:
        raise ValueError(f"framework should be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    try:
        return importlib.import_module(_MODULES[framework])
    except ImportError as e:
        raise ImportError(f"the {framework} runner needs {e.name}: "
                          f"pip install 'attn-parity[{framework}]'") from e
