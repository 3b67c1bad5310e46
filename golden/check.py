"""``attn-parity check``: every fixture through the reference, PyTorch and JAX, as a table."""

from __future__ import annotations

import numpy as np

import golden
from golden.reference import VARIANTS
from golden.tolerances import compare


def run_reference(fixture, dtype="float64") -> dict:
    """Recompute the fixture from its stored inputs with the float64 reference."""
    inputs = {n: (a.astype(np.float64) if a.dtype.kind == "f" else a)
              for n, a in fixture.inputs.items()}
    forward, backward = VARIANTS[fixture.variant]
    out, weights, cache = forward(fixture.config, inputs, fixture.params)
    cot = {n: a.astype(np.float64) for n, a in fixture.cotangents.items()}
    return {"output": out, "weights": weights,
            "grads": backward(cache, cot["output"], cot["weights"])}


def runners(fixture):
    """(framework, dtype, run_fixture) for every row of the fixture's table."""
    from jax_attn.parity import run_fixture as run_jax
    from torch_attn.parity import run_fixture as run_torch

    return [("reference", "float64", run_reference)] + [
        (name, dtype, run) for name, run in (("torch", run_torch), ("jax", run_jax))
        for dtype in fixture.dtypes]


def compare_all(fixture, result, dtype):
    """Comparisons of output, weights and every gradient; None where a gradient is missing."""
    pairs = [("output", result["output"], fixture.expected["output"]),
             ("weights", result["weights"], fixture.expected["weights"])]
    pairs += [(f"grad {n}", result["grads"].get(n), g) for n, g in fixture.grads.items()]
    return {what: None if a is None else compare(
                a, e, dtype, "grad" if what.startswith("grad ") else "value",
                terms=_terms(fixture, what))
            for what, a, e in pairs}


def _terms(fixture, what) -> int:
    """How many partial gradients each element of a gradient sums (see golden.tolerances)."""
    name = what.removeprefix("grad ")
    if name in fixture.params:  # one term per position of the longest input sequence
        return max(a.size // a.shape[-1] for a in fixture.inputs.values() if a.dtype.kind == "f")
    if name == "bias":  # the core's one input that broadcasts against the weights
        return max(1, fixture.expected["weights"].size // fixture.inputs[name].size)
    return 1


def main(names=None, log=print) -> int:
    import jax

    log(f"JAX backend: {jax.default_backend()}; devices: {', '.join(map(str, jax.devices()))}")
    names = names or golden.names()
    width = max(len("fixture"), *map(len, names))
    header = (f"{'fixture':{width}} {'framework':9} {'dtype':8} {'max abs err':>11} "
              f"{'max rel err':>11}  result")
    log(header)
    log("-" * len(header))
    passed = failed = 0
    for name in names:
        fixture = golden.load(name)
        for framework, dtype, run in runners(fixture):
            comps = compare_all(fixture, run(fixture, dtype), dtype)
            ok = all(c is not None and c.ok for c in comps.values())
            worst_abs = max(c.max_abs if c else np.inf for c in comps.values())
            worst_rel = max((c.max_rel if c else np.inf for c in comps.values()
                             if not (c and c.zero)), default=0.0)
            bad = [w for w, c in comps.items() if c is None or not c.ok]
            log(f"{name:{width}} {framework:9} {dtype:8} {worst_abs:11.2e} {worst_rel:11.2e}  "
                f"{'pass' if ok else 'FAIL ' + ', '.join(bad)}")
            passed, failed = passed + ok, failed + (not ok)
    log(f"{passed} passed, {failed} failed")
    return 1 if failed else 0
