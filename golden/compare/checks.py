"""The two checks of ``golden.compare``: ``compare`` (draw, run torch float64, torch and Flax
at the run's dtype, judge) and ``check_port`` (a Flax module against a port fixture).
"""

from __future__ import annotations

import numpy as np

from golden.specification import mapping as mapping_lib
from golden.compare.calls import (_Call, _check_call, _check_dtype, _draw, _draw_weights,
                                  _inputs, _keywords, _on_grid, _terms)
from golden.compare.mappings import _pairs, _validated
from golden.compare.port_fixture import load_port
from golden.compare.reference_steps import _with_reference_steps
from golden.compare.report import PortReport
from golden.compare.running import _built, _flax_shapes, _run_flax, _run_torch
from golden.compare.verdict import _report
from golden.runners.adapt import resolve_spec


def compare(torch_factory, flax_factory, mapping, inputs, *, keywords: dict | None = None,
            keyword_grads=(), output=None, dtype: str = "float32", seed: int = 0,
            cotangent_seed: int | None = None) -> PortReport:
    """Draw weights and inputs, run torch float64 (reference) and ``dtype`` (the baseline),
    and the Flax module jitted in ``dtype``; see ``golden.compare``'s docstring and
    docs/validating.md. ``mapping``: {torch key: flax path or (path, rule)} or
    ``neutral(...)``; ``inputs``: {name: shape or array}, passed positionally, float ones
    differentiated.

    ``keywords``: {name: value} passed by name to both modules: a shape (drawn N(0, 1)), a
    NumPy array (converted to each framework and run dtype), a tuple/list/dict of those
    (converted leaf by leaf: ``position_embeddings=(cos, sin)``), None/bool/int/float/str (as
    they are), or a factory ``f(framework, dtype)`` called once per run with framework
    "torch" or "flax" and the run's dtype name (``per_framework(torch=..., flax=...)``). Only
    the keywords named in ``keyword_grads`` (float arrays or shapes) are differentiated.

    ``output`` selects the array judged from what each module returns: None (the output if
    an array, else the first array of a tuple/list or the first value of a dict, ModelOutput
    or dataclass), an index, a name (key or field), or a callable of the output.

    ``dtype``: "float32", "bfloat16" or "float16". At a low dtype the weights and float
    inputs are drawn on that dtype's grid (every run sees the same numbers) and the Flax
    column passes where it meets the dtype's row of the tolerance table or is within 2x the
    torch baseline's error at that dtype (``tolerances.compare_to_plain``)."""
    dtype = _check_dtype(dtype)
    torch_model, flax_model = _built(torch_factory, "torch"), _built(flax_factory, "flax")
    torch_shapes = {k: tuple(p.shape) for k, p in torch_model.named_parameters()}
    table = _validated(mapping, torch_shapes, _flax_shapes(flax_model))
    pairs = _pairs(table)
    rng = np.random.default_rng(seed)
    weights = _on_grid(_draw_weights(rng, torch_shapes), dtype)
    arrays = _on_grid(_inputs(rng, inputs), dtype)
    call = _check_call(_on_grid(_keywords(rng, keywords, arrays), dtype), keyword_grads, output)
    d_rng = rng if cotangent_seed is None else np.random.default_rng(cotangent_seed)
    expected = _run_torch(torch_model, "float64", weights, arrays, pairs,
                          lambda shape: _on_grid(_draw(d_rng, shape), dtype), call)
    d_out = expected["cotangent"]
    order = list(expected["submodules"])  # the order torch's hooks fired in
    pairs.sort(key=lambda p: order.index(p[0]) if p[0] in order else len(order))
    torch32 = _run_torch(torch_model, dtype, weights, arrays, pairs, d_out, call)
    flax = _run_flax(flax_model, table, weights, arrays, d_out, pairs, call, dtype)
    data = {"seed": seed, "mapping": mapping_lib.to_json(table), "weights": weights,
            "inputs": arrays, "cotangent": d_out, "expected": expected, "pairs": pairs,
            "torch_factory": None, "flax_factory": None, "dtype": dtype,
            "keywords": call.keywords, "keyword_grads": list(call.grads), "output": output}
    report = _report(expected, flax, torch32, table, pairs, _terms(arrays), [], data)
    return _with_reference_steps(report, torch_model, flax, torch32, table, pairs,
                                 _terms(arrays))


def check_port(path, flax_factory=None, torch_factory=None) -> PortReport:
    """Check a Flax module against a port fixture: its stored weights through its stored mapping,
    jitted in the stored dtype with the stored keywords and output selection, against the
    stored float64 expectations. The factories default to the specs in the file; torch at the
    stored dtype is the baseline column when a torch factory resolves (pass
    ``torch_factory=False`` to leave it out)."""
    port, notes = load_port(path), []
    meta = port["meta"]
    if flax_factory is None:
        if not meta.get("flax_factory"):
            raise ValueError(f"flax_factory: {path} names none; pass one")
        flax_factory = resolve_spec(meta["flax_factory"])
    if torch_factory is False:
        torch_factory = None
    elif torch_factory is None and meta.get("torch_factory"):
        try:
            torch_factory = resolve_spec(meta["torch_factory"])
        except ValueError as e:
            notes.append(f"no torch baseline: {e}")
    flax_model = _built(flax_factory, "flax")
    torch_shapes = {k: tuple(port["params"][k].shape) for k in meta["params"]}
    table = _validated(meta["mapping"], torch_shapes, _flax_shapes(flax_model))
    pairs = [tuple(p) for p in meta["submodules"]]
    inputs = {n: a.astype(np.float64) if a.dtype.kind == "f" else a
              for n, a in port["inputs"].items()}
    dtype = meta["dtype"]
    call = _Call(port["keywords"], tuple(meta["keyword_grads"]), meta["output"])
    flax = _run_flax(flax_model, table, port["params"], inputs, port["cotangent"], pairs, call,
                     dtype)
    torch32 = None
    if torch_factory is not None:
        torch32 = _run_torch(_built(torch_factory, "torch"), dtype, port["params"], inputs,
                             pairs, port["cotangent"], call)
    data = {"seed": meta.get("seed"), "mapping": meta["mapping"], "weights": port["params"],
            "inputs": inputs, "cotangent": port["cotangent"], "expected": port["expected"],
            "pairs": pairs, "torch_factory": meta.get("torch_factory"),
            "flax_factory": meta.get("flax_factory"), "dtype": dtype,
            "keywords": port["keywords"], "keyword_grads": list(meta["keyword_grads"]),
            "output": meta["output"]}
    return _report(port["expected"], flax, torch32, table, pairs, _terms(inputs), notes, data)
