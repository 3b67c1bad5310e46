"""Compare a user's PyTorch module with their Flax NNX port: ``attn-parity compare``.

``compare(torch_factory, flax_factory, mapping, inputs)`` draws weights in the torch layout and
inputs, sets the same weights in both modules through the mapping (torch state-dict key -> Flax
parameter path, with a ``golden.mapping`` rule from the torch layout to the Flax one), and runs

    torch float64       the reference: output, gradients of L = Σ output ⊙ dO for every
                        parameter and float input, outputs of the paired submodules (hooks)
    torch float32       the same, shown as the same-precision baseline (or ``dtype``)
    Flax float32        one ``nnx.jit`` program: output, gradients (mapped back to the torch
                        layout through the rule's inverse), every submodule's ``__call__``
                        output (``nnx.capture(..., method_outputs=nnx.Intermediate)``)

and judges the Flax float32 column against torch float64 with ``golden.tolerances.compare``.
``dtype="bfloat16"`` or ``"float16"`` runs the baseline and the Flax module in that dtype and
judges with ``golden.tolerances.compare_to_plain`` (the dtype's row, or at most 2x the torch
baseline's error). Inputs go positionally (``inputs``) and by name (``keywords``: arrays,
nested arrays, plain values, per-run factories); ``output`` selects the array judged from a
tuple, dict, ``ModelOutput`` or dataclass, the same way in both frameworks.
The verdict is on the output and the gradients; a paired submodule is a module owning a mapped
parameter on each side (``golden.mapping.submodule``), and the first one in torch's execution
order whose Flax output misses the float32 value tolerance is named as where the port diverges.
Both modules run in eval mode; by default a module returning a tuple is judged on its first
array, one returning a dict or ModelOutput on its first value.

``freeze`` writes what was drawn and the float64 expectations as a port fixture (the container
of ``golden.fixture``: a zip of ``.npy`` members, never pickled), and ``check_port`` checks a
Flax module against such a file without torch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from golden import mapping as mapping_lib
from golden import tolerances
from golden.fixture import FixtureError, read_members, to_bytes, write_atomic
from golden.frameworks import JAX, TORCH
from golden.report import plain
from golden.runners.adapt import SPEC, resolve_spec

FORMAT = "attn-parity-port"
FORMAT_VERSION = 3
# 2: the paired submodules' inputs (meta "submodule_inputs", members submodule_inputs/<torch
# path>), which locate a divergence between two submodules
# 3: the run's dtype, keyword inputs (meta "keywords", members keywords/<name>/...), the
# keywords differentiated ("keyword_grads") and the output selection ("output"); versions 1
# and 2 are still read, as float32 runs without keywords (version 1: located by the
# submodules' outputs alone)
FORMAT_VERSIONS = (1, 2, 3)
RUN_DTYPES = ("float32", "bfloat16", "float16")  # what compare(dtype=...) runs the port in
# 2: a number that is not finite is null, as in every report of this project (golden.report.plain)
# 3: each comparison (a row's "torch_float32", "flax_float32") also states the bounds it was held
#    to: "abs_err", "bound_abs", "bound_rel_norm", "rule" (golden.tolerances.Comparison); the
#    report gains "diagnosis", "interval" (where the port parts from the reference), "reference"
#    (the float32 steps inside the torch float64 reference and how far they move it) and "dtype";
#    rows "input of A ~ B" compare a paired submodule's input
SCHEMA = {"schema": "attn-parity-compare", "schema_version": 3}


# ---------------------------------------------------------------- specs and mappings


def neutral(torch_table: dict, flax_table: dict, shapes: dict | None = None) -> dict:
    """{torch key: (flax path, Rule)} from two tables {neutral name: (path, rule)} that map the
    neutral layout (y = x W + b, W of shape (in, out)) to each module. The composed rule is the
    torch rule inverted, then the Flax rule. Inverting a reshape needs the neutral shape:
    ``shapes`` = {neutral name: shape} for the names whose torch rule reshapes."""
    t, f = mapping_lib.parse(torch_table), mapping_lib.parse(flax_table)
    if set(t) != set(f):
        raise ValueError(f"neutral: the tables should name the same neutral arrays; only torch "
                         f"has {sorted(set(t) - set(f))}, only Flax has {sorted(set(f) - set(t))}")
    out = {}
    for name, (torch_key, torch_rule) in t.items():
        flax_path, flax_rule = f[name]
        steps = _inverse_steps(name, torch_rule, (shapes or {}).get(name))
        out[torch_key] = (flax_path, mapping_lib.Rule(_simplified(steps + flax_rule.steps)))
    return out


def _inverse_steps(name, rule, neutral_shape) -> tuple:
    """The steps that undo ``rule`` (neutral -> torch), from the torch layout back."""
    if neutral_shape is None and any(s[0] == "reshape" for s in rule.steps):
        raise ValueError(f"neutral: the torch rule {rule} of {name!r} reshapes; pass "
                         f"shapes={{{name!r}: its neutral shape}} to invert it")
    chain = rule.shapes(neutral_shape) if neutral_shape is not None else [None] * (
        len(rule.steps) + 1)
    out = []
    for step, before in zip(reversed(rule.steps), reversed(chain[:-1])):
        if step[0] == "T":
            out.append(("T",))
        elif step[0] == "transpose":
            out.append(("transpose", tuple(int(a) for a in np.argsort(step[1]))))
        else:
            out.append(("reshape", tuple(before)))
    return tuple(out)


def _simplified(steps) -> tuple:
    """Steps with T;T pairs dropped and adjacent transposes merged into one."""
    out = []
    for step in steps:
        if out and step[0] == "T" and out[-1][0] == "T":
            out.pop()
        elif out and step[0] == "transpose" and out[-1][0] == "transpose":
            merged = tuple(out.pop()[1][a] for a in step[1])
            if merged != tuple(range(len(merged))):
                out.append(("transpose", merged))
        else:
            out.append(step)
    return tuple(out)


def _validated(table, torch_shapes: dict, flax_shapes: dict) -> dict:
    """The parsed mapping, checked against both modules' parameters; ValueError naming the
    key or path that is unmapped, unknown, or whose shape does not follow the rule."""
    table = mapping_lib.parse(table)
    targets = [path for path, _ in table.values()]
    problems = [f"{what}: {names}" for what, names in (
        ("torch parameters not mapped", [k for k in torch_shapes if k not in table]),
        ("keys that are not torch parameters (buffers are not mapped)",
         [k for k in table if k not in torch_shapes]),
        ("Flax parameters no key maps to", [p for p in flax_shapes if p not in targets]),
        ("targets that are not Flax nnx.Param paths", [p for p in targets if p not in flax_shapes]),
    ) if names]
    if problems:
        raise ValueError("mapping: " + "; ".join(problems))
    for key, (path, rule) in table.items():
        try:
            got = rule.target_shape(torch_shapes[key])
        except ValueError as e:
            raise ValueError(f"mapping: {key} -> {path}: {e}") from None
        if got != flax_shapes[path]:
            raise ValueError(f"mapping: {key} -> {path}: rule {rule} gives shape {got} from "
                             f"{torch_shapes[key]}, the Flax parameter has shape "
                             f"{flax_shapes[path]}")
    return {k: table[k] for k in torch_shapes}  # in torch's parameter order


def _pairs(table) -> list:
    """(torch module path, Flax module path) owning mapped parameters, the top level left out."""
    pairs = []
    for key, (path, _) in table.items():
        pair = (mapping_lib.submodule(key), mapping_lib.submodule(path))
        if "" not in pair and pair not in pairs:
            pairs.append(pair)
    return pairs


# ---------------------------------------------------------------- drawing


def _draw(rng, shape, std=1.0) -> np.ndarray:
    """N(0, std²) rounded to float32, kept as float64: every run sees the same numbers."""
    return (rng.standard_normal(shape) * std).astype(np.float32).astype(np.float64)


def _draw_weights(rng, shapes: dict) -> dict:
    """Torch-layout weights: N(0, 1/fan_in) with fan_in the last axis; vectors N(0, 0.25)."""
    return {k: _draw(rng, s, 1 / math.sqrt(s[-1]) if len(s) >= 2 else 0.5)
            for k, s in shapes.items()}


def _inputs(rng, inputs: dict) -> dict:
    """{name: array}: shapes drawn N(0, 1), float arrays rounded to float32, others as given."""
    if not isinstance(inputs, dict) or not inputs:
        raise ValueError(f"inputs should be a non-empty dict {{name: shape or array}}, got "
                         f"{inputs!r}")
    out = {}
    for name, value in inputs.items():
        if isinstance(value, (tuple, list)):
            if not all(isinstance(d, int) and d > 0 for d in value):
                raise ValueError(f"inputs[{name!r}] should be a shape of positive ints, got "
                                 f"{value!r}")
            out[name] = _draw(rng, tuple(value))
        else:
            a = np.asarray(value)
            out[name] = a.astype(np.float32).astype(np.float64) if a.dtype.kind == "f" else a
    return out


def _terms(inputs: dict) -> int:
    """Positions a parameter's gradient sums over: the first input's shape but its last axis."""
    return math.prod(next(iter(inputs.values())).shape[:-1])


# ---------------------------------------------------------------- keyword inputs and outputs

_PLAIN_TYPES = (type(None), bool, int, float, str)


def _is_shape(value) -> bool:
    return (isinstance(value, (tuple, list)) and len(value) > 0
            and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value))


def _keywords(rng, keywords, inputs: dict) -> dict:
    """{name: value} with every shape drawn N(0, 1) and every array copied (float arrays
    rounded to float32, kept float64), through tuples, lists and dicts; None, bools, ints,
    floats, strings and factories (callables) kept as they are."""
    if keywords is None:
        return {}
    if not isinstance(keywords, dict) or not all(isinstance(n, str) for n in keywords):
        raise ValueError(f"keywords should be a dict {{name: value}}, got {keywords!r}")
    clash = [n for n in keywords if n in inputs]
    if clash:
        raise ValueError(f"keywords: {clash} are also positional inputs; name each once")
    return {n: _prepared(rng, v, f"keywords[{n!r}]") for n, v in keywords.items()}


def _prepared(rng, value, where):
    if _is_shape(value):
        return _draw(rng, tuple(value))
    if isinstance(value, (np.ndarray, np.generic)):
        a = np.array(value)  # a copy
        if a.dtype.kind not in "biuf":
            raise ValueError(f"{where} should hold numbers or bools, got dtype {a.dtype}")
        return a.astype(np.float32).astype(np.float64) if a.dtype.kind == "f" else a
    if isinstance(value, (tuple, list)):
        return type(value)(_prepared(rng, v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, dict):
        return {k: _prepared(rng, v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, _PLAIN_TYPES) or callable(value):
        return value
    raise ValueError(f"{where} should be a shape, a NumPy array, a tuple/list/dict of those, "
                     f"None, a bool, int, float or string, or a factory(framework, dtype); got "
                     f"{type(value).__name__}")


def _leafwise(fn, value):
    """``fn`` applied to every leaf of ``value`` through tuples, lists and dicts (their types
    and keys kept)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_leafwise(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _leafwise(fn, v) for k, v in value.items()}
    return fn(value)


def _converted(value, framework: str, dtype: str):
    """A prepared keyword value for one run: arrays as the framework's (floats in ``dtype``,
    64-bit integers as JAX's integers without x64), factories called with (framework, dtype),
    the rest as it is. ``framework`` is "torch" or "flax"."""
    adapter = TORCH if framework == "torch" else JAX

    def leaf(v):
        if isinstance(v, np.ndarray):
            return adapter.array(v, dtype)
        return v(framework, dtype) if callable(v) else v

    return _leafwise(leaf, value)


def per_framework(*, torch=None, flax=None):
    """A keyword factory with one value per framework. Each is a callable of the run's dtype
    name ("float64", "float32", "bfloat16", "float16"), called once per run (a fresh cache
    each run), or a value passed as it is; a framework left out gets None."""
    return _PerFramework({"torch": torch, "flax": flax})


@dataclass(frozen=True)
class _PerFramework:
    values: dict

    def __call__(self, framework, dtype):
        value = self.values[framework]
        return value(dtype) if callable(value) else value

    def __repr__(self):
        return f"per_framework(torch={self.values['torch']!r}, flax={self.values['flax']!r})"


@dataclass(frozen=True)
class _Call:
    """How both modules are called and what is judged: keyword inputs (prepared by
    ``_keywords``), the keywords whose arrays are differentiated, the output selection."""

    keywords: dict = field(default_factory=dict)
    grads: tuple = ()
    output: object = None

    def kwargs(self, framework, dtype) -> dict:
        return {n: _converted(v, framework, dtype) for n, v in self.keywords.items()}

    def select(self, out, framework):
        """The array ``output`` selects from a module's output; ValueError when it is absent
        or not an array."""
        got = _selected(out, self.output, framework)
        if not hasattr(got, "shape") or not hasattr(got, "dtype"):
            raise ValueError(f"output: what {self.output!r} selects from the {framework} "
                             f"module's output is a {type(got).__name__}, not an array")
        return got


_PLAIN_CALL = _Call()


def _items(x):
    """[(name or None, value)] of a structured output, or None for anything else."""
    if isinstance(x, Mapping):  # dict, HF ModelOutput (an OrderedDict of its non-None fields)
        return list(x.items())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [(f.name, getattr(x, f.name)) for f in dataclasses.fields(x)]
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return list(zip(x._fields, x))
    if isinstance(x, (tuple, list)):
        return [(None, v) for v in x]
    return None


def _first_array(x, sort_keys=False):
    """A module's output, or the first array of a tuple/list, the first value of a dict,
    ModelOutput or dataclass (recursively); None for an empty one. ``sort_keys``: a dict's
    value of the smallest key instead, for submodule outputs: ``nnx.capture`` keeps a dict
    with its keys sorted (a JAX pytree), so both frameworks read the same entry."""
    while (items := _items(x)) is not None:
        if not items:
            return None
        x = (min(items, key=lambda i: i[0]) if sort_keys and isinstance(x, Mapping)
             else items[0])[1]
    return x


def _selected(out, output, framework):
    if output is None:
        return _first_array(out)
    if callable(output):
        return output(out)
    items = _items(out)
    kind = type(out).__name__
    if isinstance(output, int):
        if items is None:
            raise ValueError(f"output: index {output} given, but the {framework} module's "
                             f"output is a {kind}, not a tuple, list, dict or dataclass")
        if not -len(items) <= output < len(items):
            raise ValueError(f"output: index {output} is out of range for the {framework} "
                             f"module's output ({kind} of {len(items)} items)")
        return items[output][1]
    names = [n for n, _ in items or [] if n is not None]
    if output not in names:
        raise ValueError(f"output: the {framework} module's output ({kind}) has no {output!r}; "
                         f"it has {names if names else 'no names'}")
    return dict((n, v) for n, v in items if n is not None)[output]


def _check_call(keywords: dict, keyword_grads, output) -> _Call:
    grads = tuple(keyword_grads)
    bad = [n for n in grads if not (isinstance(keywords.get(n), np.ndarray)
                                    and keywords[n].dtype.kind == "f")]
    if bad:
        raise ValueError(f"keyword_grads should name keywords whose value is a float array or "
                         f"a shape, got {bad} (keywords: {list(keywords)})")
    if not (output is None or callable(output) or isinstance(output, str)
            or (isinstance(output, int) and not isinstance(output, bool))):
        raise ValueError(f"output should be None, an index, a name or a callable, got "
                         f"{output!r}")
    return _Call(keywords, grads, output)


def _check_dtype(dtype) -> str:
    if dtype not in RUN_DTYPES:
        raise ValueError(f"dtype should be one of {', '.join(RUN_DTYPES)}, got {dtype!r}")
    return dtype


# ---------------------------------------------------------------- running the modules


def _run_torch(module, dtype: str, weights: dict, inputs: dict, pairs: list, cotangent,
               call: _Call = _PLAIN_CALL) -> dict:
    """Output, gradients (parameters, float inputs and the keywords ``call`` differentiates)
    and first-call outputs of the paired torch submodules, in the order they ran.
    ``cotangent`` is dO, or a function of the output shape that draws it (returned as
    "cotangent")."""
    import torch

    module = copy.deepcopy(module).to(TORCH.dtype(dtype)).eval()
    with torch.no_grad():
        for k, p in module.named_parameters():
            p.copy_(TORCH.array(weights[k]))
            p.requires_grad_(True)  # a frozen parameter is compared like the others
    args = list(TORCH.leaves(inputs, dtype).values())
    kwargs = call.kwargs("torch", dtype)
    for n in call.grads:
        kwargs[n].requires_grad_(True)
    captured, captured_in, hooks = {}, {}, []
    for path in dict.fromkeys(t for t, _ in pairs):
        def hook(_m, _in, out, path=path):
            captured.setdefault(path, TORCH.numpy(_first_array(out, sort_keys=True)))

        def pre_hook(_m, args, kwargs, path=path):  # the first call's first array argument
            if path not in captured_in:
                first = _first_tensor(torch, (*args, *kwargs.values()))
                captured_in[path] = TORCH.numpy(first) if first is not None else None
        sub = module.get_submodule(path)
        hooks += [sub.register_forward_pre_hook(pre_hook, with_kwargs=True),
                  sub.register_forward_hook(hook)]
    try:
        out = call.select(_call("torch", module, args, inputs, kwargs), "torch")
    finally:
        for h in hooks:
            h.remove()
    d_out = cotangent(tuple(out.shape)) if callable(cotangent) else cotangent
    (out * TORCH.array(d_out, dtype)).sum().backward()
    grads = {k: TORCH.numpy(p.grad) if p.grad is not None else np.zeros(p.shape)
             for k, p in module.named_parameters()}
    grads.update({f"input.{n}": TORCH.numpy(a.grad) for n, a in zip(inputs, args)
                  if a.requires_grad})
    grads.update({f"input.{n}": TORCH.numpy(kwargs[n].grad) if kwargs[n].grad is not None
                  else np.zeros(kwargs[n].shape) for n in call.grads})
    return {"output": TORCH.numpy(out), "grads": grads, "submodules": captured,
            "submodule_inputs": {p: a for p, a in captured_in.items() if a is not None},
            "cotangent": d_out}


def _first_tensor(torch, values):
    """The first floating-point tensor among ``values`` that comes before any other array (an
    integer or boolean first array, token ids or a mask, is not compared: None)."""
    first = next((v for v in values if isinstance(v, torch.Tensor)), None)
    return first if first is not None and first.is_floating_point() else None


def _call(framework, module, args, inputs, kwargs=None):
    """module(*args, **kwargs), a failure turned into a ValueError naming the inputs' shapes."""
    try:
        return module(*args, **(kwargs or {}))
    except ValueError as e:
        if str(e).startswith("output:"):  # the output selection's own message
            raise
        return _failed(framework, e, inputs)
    except Exception as e:
        return _failed(framework, e, inputs)


def _failed(framework, e, inputs):
    shapes = {n: tuple(a.shape) for n, a in inputs.items()}
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise ValueError(f"inputs: the {framework} module failed on inputs {shapes}: "
                     f"{type(e).__name__}: {first}") from e


def _built(factory, framework):
    """factory(), checked to be a torch.nn.Module or an nnx.Module."""
    if framework == "torch":
        from torch.nn import Module
    else:
        from flax.nnx import Module
    model = factory()
    if not isinstance(model, Module):
        kind = "torch.nn.Module" if framework == "torch" else "flax.nnx.Module"
        raise ValueError(f"{framework}_factory should return a {kind}, got "
                         f"{type(model).__name__}")
    return model


def _flax_shapes(model) -> dict:
    from flax import nnx

    return {_join(p): tuple(v.get_value().shape)
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _join(path) -> str:
    return ".".join(str(p) for p in path)


def _set_flax_params(model, table, weights, dtype="float32") -> None:
    """Every nnx.Param set to its torch weight through the rule, in ``dtype``."""
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    source = {path: (key, rule) for key, (path, rule) in table.items()}
    for p, var in nnx.to_flat_state(state):
        key, rule = source[_join(p)]
        var.set_value(JAX.array(rule.apply(weights[key]), dtype))
    nnx.update(model, state)


_CALL_INPUT = "__call_input__"  # the name a paired Flax submodule's call input is sown under


@contextlib.contextmanager
def _sowing_call_inputs(modules):
    """While open, each module's class's ``__call__`` sows its first array argument (when it
    is a float array) as an ``nnx.Intermediate`` named ``_CALL_INPUT``, next to the output
    ``nnx.capture(..., method_outputs=...)`` sows (which records outputs only, flax 0.12).
    The class is patched, as ``nnx.capture`` patches it, since Python looks ``__call__`` up on
    the type; the original is put back on leaving."""
    patched = {}
    for m in modules:
        cls = next(c for c in type(m).__mro__ if "__call__" in c.__dict__)
        if cls not in patched:
            patched[cls] = cls.__dict__["__call__"]
            cls.__call__ = _sowing_input(patched[cls])
    try:
        yield
    finally:
        for cls, method in patched.items():
            cls.__call__ = method


def _sowing_input(method):
    """``method`` (a ``__call__``) that first sows its first array argument, if float."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, jax.Array)), None)
        if (first is not None and jnp.issubdtype(first.dtype, jnp.floating)
                and hasattr(self, "__captures__")):  # only inside nnx.capture
            self.sow(nnx.Intermediate, _CALL_INPUT, first)
        return method(self, *args, **kwargs)

    return wrapper


def _run_flax(model, table, weights: dict, inputs: dict, d_out, pairs=(),
              call: _Call = _PLAIN_CALL, dtype: str = "float32") -> dict:
    """Output, gradients in torch names and layout, and every submodule's first __call__
    output and, for the paired ones, its first call's first array argument, from one nnx.jit
    program in ``dtype``. Keyword inputs are closed over (constants of the program), but for
    the differentiated ones, which are arguments."""
    import jax.numpy as jnp
    from flax import nnx

    _set_flax_params(model, table, weights, dtype)
    model.eval()
    arrays = JAX.leaves(inputs, dtype)
    kwargs = call.kwargs("flax", dtype)
    floats = {n: a for n, a in arrays.items() if jnp.issubdtype(a.dtype, jnp.floating)}
    floats.update({n: kwargs.pop(n) for n in call.grads})
    others = {n: a for n, a in arrays.items() if n not in floats}

    paired = {f for _, f in pairs}

    @nnx.jit
    def step(model, floats, others, d_out):
        def loss(model, floats):
            args = [{**others, **floats}[n] for n in arrays]
            given = {**kwargs, **{n: floats[n] for n in call.grads}}
            subs = [m for p, m in nnx.iter_modules(model) if _join(p) in paired]
            with _sowing_call_inputs(subs):
                out, inter = nnx.capture(model, nnx.Intermediate,
                                         method_outputs=nnx.Intermediate)(*args, **given)
            out = call.select(out, "flax")
            return jnp.sum(out * d_out), (out, inter)

        argnums = (nnx.DiffState(0, nnx.Param), 1)
        (_, (out, inter)), (g_model, g_in) = nnx.value_and_grad(
            loss, argnums=argnums, has_aux=True)(model, floats)
        return out, g_model, g_in, inter

    out, g_model, g_in, inter = _call("Flax", step, (model, floats, others,
                                                     JAX.array(d_out, dtype)), inputs)
    g_flax = {_join(p): JAX.numpy(v.get_value()) for p, v in nnx.to_flat_state(g_model)}
    grads = {k: rule.inverse(g_flax[path], weights[k].shape) for k, (path, rule) in table.items()}
    grads.update({f"input.{n}": JAX.numpy(g) for n, g in g_in.items()})
    sown = {name: {_join(p[:-1]): JAX.numpy(_first_array(v.get_value()[0], sort_keys=True))
                   for p, v in nnx.to_flat_state(inter) if p[-1] == name and len(p) > 1}
            for name in ("__call__", _CALL_INPUT)}
    return {"output": JAX.numpy(out), "grads": grads, "submodules": sown["__call__"],
            "submodule_inputs": sown[_CALL_INPUT]}


# ---------------------------------------------------------------- the report


@dataclass
class PortReport:
    """Rows of comparisons with torch float64; the verdict is the Flax float32 column's on the
    output and every gradient (submodule rows locate a divergence, they do not decide).
    ``suspects`` are the mapped parameters the divergence may come from: a gradient depends on
    every activation after its parameter, so one wrong weight fails most gradients, while the
    submodules' inputs and outputs, compared in execution order, say where the runs part
    (``diagnosis``): inside a submodule (its parameters are suspects), or in the code between
    two (no parameter is, unless the port bypasses a paired submodule's ``__call__``).
    ``first_divergent`` is the first paired submodule whose output diverges."""

    ok: bool
    rows: list
    first_divergent: str | None
    failing_params: list
    suspects: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    data: dict = field(default_factory=dict, repr=False)  # what freeze() writes
    # where the Flax run first parts from the reference (golden.compare._locate): a sentence,
    # and [A, B] when that is the code between two paired submodules (None: the module's
    # inputs or output), None otherwise
    diagnosis: str | None = None
    interval: list | None = None
    # float32 steps inside the torch float64 reference and their effect (_reference_steps)
    reference: dict = field(default_factory=dict)

    def text(self) -> str:
        """A readable table: max |Δ| and the relative error norm per column, the Flax column's
        each beside the bound it was held to (the elementwise check's at its deciding element,
        golden.tolerances.Comparison), then the verdict."""
        width = max(len(r["what"]) for r in self.rows) + 2
        dtype = self.data.get("dtype", "float32")
        lines = [f"{'':{width}}{'flax path':16}{'rule':8}{'torch ' + dtype:28}flax {dtype}",
                 f"{'':{width + 24}}{'max|Δ|   rel‖Δ‖':28}"
                 f"{'max|Δ|':9}{'rel‖Δ‖/bound':17}|Δᵢ|/boundᵢ"]
        for r in self.rows:
            lines.append(f"{r['what']:{width}}{r['flax_path'] or '-':16}{r['rule'] or '-':8}"
                         f"{_cell(r['torch_float32']):28}"
                         f"{_cell(r['flax_float32'], r, bounds=True)}")
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"first diverging submodule: {self.first_divergent or 'none'}")
        if self.suspects:
            lines.append("  suspect parameters: " + ", ".join(self.suspects))
        lines.append(f"diagnosis: {self.diagnosis or 'no divergence'}")
        if self.ok:
            lines.append("pass")
        else:
            failing = [r["what"] for r in self.rows[:1] if not r["ok"]]
            failing += [f"grad {k}" for k in self.failing_params]
            failing += [r["what"] for r in self.rows if r["what"].startswith("grad input")
                        and not r["ok"]]
            lines.append(f"FAIL: {', '.join(failing)}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """JSON-ready (schema ``SCHEMA``, version 3): the verdict, the rows and the notes; each
        row's "torch_float32" and "flax_float32" are ``golden.tolerances.Comparison`` fields, the
        errors and the bounds they were held to; a number that is not finite is None (null in
        JSON), NumPy values are Python values (golden.report.plain)."""
        return plain({"ok": self.ok, "first_divergent": self.first_divergent,
                      "failing_params": self.failing_params, "suspects": self.suspects,
                      "diagnosis": self.diagnosis, "interval": self.interval,
                      "reference": self.reference,
                      "rows": self.rows, "notes": self.notes, "seed": self.data.get("seed"),
                      "dtype": self.data.get("dtype", "float32"),
                      "mapping": self.data.get("mapping")})


def _cell(c, row=None, bounds=False) -> str:
    """A column's cell: max |Δ|, the relative error norm ("(zero)": not applied) and the
    verdict; with ``bounds``, rel‖Δ‖ / its bound and |Δᵢ| / boundᵢ at the elementwise check's
    deciding element (golden.tolerances.Comparison: it passes exactly when |Δᵢ| ≤ boundᵢ)."""
    if c is None:
        return (row or {}).get("note") or "-"
    verdict = "pass" if c["ok"] else "FAIL"
    if not bounds or c.get("bound_abs") is None:
        rel = "(zero)" if c["zero"] else f"{c['rel_norm']:.1e}"
        return f"{c['max_abs']:.1e}  {rel:7}  {verdict}"
    rel = ("(zero)" if c["bound_rel_norm"] is None
           else f"{c['rel_norm']:.1e}/{c['bound_rel_norm']:.1e}")
    return (f"{c['max_abs']:.1e}  {rel:15}  {c['abs_err']:.1e}/{c['bound_abs']:.1e}  "
            f"{verdict}")


def _judged(got, e, baseline, dtype, kind, terms=1, zero=False):
    """The Flax array against the float64 one: the float32 table at float32; at bfloat16 and
    float16 the dtype's row of the table, or failing it at most 2x the torch baseline's error
    at that dtype on the same inputs (``tolerances.compare_to_plain``; the table alone without
    a baseline)."""
    if dtype == "float32" or baseline is None:
        return tolerances.compare(got, e, dtype, kind, terms=terms, zero=zero)
    return tolerances.compare_to_plain(got, e, baseline, dtype, kind, terms, zero)


def _report(expected: dict, flax: dict, torch32: dict | None, table: dict, pairs: list,
            terms: int, notes: list, data: dict) -> PortReport:
    """Judge the Flax run (and show torch's at the same dtype) against torch float64; the
    columns keep the names torch_float32 and flax_float32 at every dtype (data["dtype"])."""
    dtype = data.get("dtype", "float32")

    def row(what, key, kind, n, flax_path=None, rule=None, group=None):
        e = expected[group][key] if group else expected[key]
        got = [(r[group][key] if group else r[key]) if r is not None else None
               for r in (torch32, flax)]
        zero = group == "grads" and _zero(e, n)
        cmp = [None if got[0] is None else dataclasses.asdict(
            tolerances.compare(got[0], e, dtype, kind, terms=n, zero=zero)),
            dataclasses.asdict(_judged(got[1], e, got[0], dtype, kind, n, zero))]
        return {"what": what, "torch_float32": cmp[0], "flax_float32": cmp[1],
                "flax_path": flax_path, "rule": rule, "ok": cmp[1]["ok"]}

    rows = [row("output", "output", "value", 1)]
    for key, (path, rule) in table.items():
        rows.append(row(f"grad {key}", key, "grad", terms, path, str(rule), "grads"))
    for name in (k for k in expected["grads"] if k.startswith("input.")):
        rows.append(row(f"grad input {name[6:]}", name, "grad", 1, group="grads"))
    sub_rows, steps = _submodule_rows(expected, flax, torch32, pairs, notes, dtype)
    failing = [k for k, r in zip(table, rows[1:]) if not r["ok"]]
    ok = all(r["ok"] for r in rows)
    grads_failing = [r["what"] for r in rows[1:] if not r["ok"]]
    where = _locate(steps, rows[0]["ok"], grads_failing)
    first = next((s["pair"] for s in steps if s["output"] is False), None)
    suspects = [f"{k} -> {path} (rule {rule})" for k, (path, rule) in table.items()
                if (mapping_lib.submodule(k), mapping_lib.submodule(path)) in where["owners"]]
    return PortReport(ok, rows + sub_rows, first and " ~ ".join(first), failing, suspects,
                      notes, data, where["diagnosis"], where["interval"])


def _zero(expected, terms) -> bool:
    """A float64 gradient within float64 rounding of zero is taken as zero by structure (a
    key-projection bias: softmax ignores a constant added to a row) and judged, as the
    project's fixtures judge such gradients, by the absolute bound alone."""
    return tolerances.compare(expected, np.zeros_like(expected), "float64", "grad",
                              terms=terms, zero=True).ok


def _submodule_rows(expected, flax, torch32, pairs, notes, dtype="float32"):
    """Rows for the paired submodules in torch's execution order (each one's input, when it is
    a float array both sides recorded, then its output), and per pair what was found:
    {"pair", "missing" (None, or the side that never called it), "input", "output"}: True (agrees),
    False (diverges) or None (not compared)."""
    rows, steps = [], []
    if "submodule_inputs" not in expected:
        notes.append("the expectations hold no submodule inputs (a port fixture of format "
                     "version 1): divergences are located by submodule outputs alone")
    for t, f in pairs:
        label = f"{t} ~ {f}"
        step = {"pair": (t, f), "missing": None, "input": None, "output": None}
        steps.append(step)
        e, got = expected["submodules"].get(t), flax["submodules"].get(f)
        if e is None or got is None:
            step["missing"] = "torch" if e is None else "Flax"
            notes.append(f"submodule {label}: not called in {step['missing']}" + (
                f": the port does not call `{f}`'s `__call__`, so its output is compared nowhere"
                if e is not None else ""))
            continue
        for part, group in (("input", "submodule_inputs"), ("output", "submodules")):
            what = f"submodule {label}" if part == "output" else f"input of {label}"
            e, got = expected.get(group, {}).get(t), flax.get(group, {}).get(f)
            if e is None or got is None:
                continue  # an input that is not a float array, or not recorded
            if got.size != e.size:
                rows.append({"what": what, "torch_float32": None, "flax_float32": None,
                             "flax_path": f, "rule": None, "ok": None,
                             "note": f"shapes differ: {e.shape} vs {got.shape}"})
                step[part] = False
                continue
            base = None if torch32 is None else torch32.get(group, {}).get(t)
            cmp = [None if base is None else dataclasses.asdict(
                tolerances.compare(base.reshape(e.shape), e, dtype, "value")),
                dataclasses.asdict(_judged(got.reshape(e.shape), e, base, dtype, "value"))]
            rows.append({"what": what, "torch_float32": cmp[0], "flax_float32": cmp[1],
                         "flax_path": f, "rule": None, "ok": cmp[1]["ok"]})
            step[part] = cmp[1]["ok"]
    return rows, steps


def _locate(steps, output_ok, grads_failing) -> dict:
    """Where the Flax run first parts from the reference, walking the paired submodules in
    torch's execution order: {"diagnosis": text or None, "interval": [A, B] or None, "owners":
    the pairs whose parameters are suspects}. A pair whose input already differs while the
    pair before it agreed puts the divergence in the code between them (A None: the module's
    inputs), where no mapped parameter is used, so that pair's own weights are not suspects;
    a pair whose input agrees and output does not puts it inside that pair; every pair agreeing
    and the output not puts it after the last one (B None: the module's output). A pair one
    side never called is stepped over: its output is compared nowhere, so the parameters of
    one the port does not call are suspects wherever the divergence shows after it."""
    def name(pair):
        return None if pair is None else " ~ ".join(pair)

    last, skipped, since = None, [], []  # the last pair that agreed; pairs the port does not
    for s in steps:                     # call before here, and since ``last``
        if s["missing"]:
            skipped += [s["pair"]] if s["missing"] == "Flax" else []
            since += [s["pair"]] if s["missing"] == "Flax" else []
            continue
        if s["output"] is False:
            b = name(s["pair"])
            if s["input"] is False:
                where = f"after `{name(last)}`, before `{b}`" if last else f"before `{b}`"
                text = (f"diverges {where}: in the code between "
                        f"{'them' if last else 'the module inputs and it'}"
                        f"{'' if since else ', where no mapped parameter is used'} (the input "
                        f"of `{b}` already differs, so its parameters are not suspects)")
                return _diagnosis(text, [name(last), b], skipped, since=since)
            if s["input"] is True:
                return _diagnosis(f"diverges inside `{b}`: its input agrees, its output "
                                  f"does not (its parameters or its code)", None, [],
                                  owners=[s["pair"]])
            text = (f"diverges by the output of `{b}`, whose input could not be compared (not a "
                    f"float array): inside it, or in the code before it"
                    + (f", after `{name(last)}`" if last else ""))
            return _diagnosis(text, None, skipped, owners=[s["pair"]])
        last, since = s["pair"], []  # its input may differ, its output agree (a norm's scale)
    if not output_ok:
        text = (f"diverges after `{name(last)}`, in the code that follows it: every paired "
                f"submodule agrees, the output does not" if last else
                "diverges in the module's own code: no paired submodule could be compared")
        return _diagnosis(text, [name(last), None], skipped, since=since)
    if grads_failing:
        text = (f"the output and every compared submodule agree, but {', '.join(grads_failing)} "
                f"do not: the backward pass differs (a stop_gradient, a custom VJP, a parameter "
                f"used outside the differentiated path)")
        return _diagnosis(text, None, skipped)
    return {"diagnosis": None, "interval": None, "owners": []}


def _diagnosis(text, interval, skipped, owners=(), since=()) -> dict:
    """The diagnosis with the pairs the port never called named (``since``: those torch runs
    inside the interval): their parameters are suspects, since the code that replaces their
    ``__call__`` is compared nowhere."""
    owners = list(owners)
    for t, f in skipped:
        text += (f"; the port does not call `{f}`'s `__call__` ({t} ~ {f}"
                 f"{', which torch runs there' if (t, f) in since else ''}), so what it does "
                 f"instead is compared nowhere and its parameters are suspects too")
        owners.append((t, f))
    return {"diagnosis": text, "interval": interval, "owners": owners}


# ---------------------------------------------------------------- float32 inside float64


_LOW = ("float32", "float16", "bfloat16")
_NO_ARITHMETIC = {"detach", "alias", "view", "_unsafe_view", "expand", "t", "transpose",
                  "permute", "clone", "lift_fresh"}  # not listed as float32 steps


def _with_reference_steps(report, module, flax, torch32, table, pairs, terms) -> PortReport:
    """``report`` with ``reference`` (and a note) saying which ops of the torch float64
    reference ran in float32 or lower, in which module, and how far keeping them in float64
    moves the output and gradients. The verdict stays with the reference as run (the user's
    torch code is the specification, float32 steps included); the note says whether the
    verdict would be the same against the promoted one."""
    d = report.data
    call = _Call(d.get("keywords", {}), tuple(d.get("keyword_grads", ())), d.get("output"))
    run = (module, "float64", d["weights"], d["inputs"], pairs, d["cotangent"], call)
    import torch

    try:
        steps = _float32_steps(*run)
        report.reference = {"float32_steps": steps}
        if not steps:
            return report
        with _KeepFloat64(torch):
            kept = _run_torch(*run)
    except Exception as e:  # a module a dispatch mode cannot run: the comparison stands
        report.reference = {"error": f"{type(e).__name__}: {str(e).strip()[:200]}"}
        report.notes.append(f"float32 steps in the torch float64 reference not measured: "
                            f"{report.reference['error']}")
        return report
    e = d["expected"]
    moves = {"output": tolerances.compare(kept["output"], e["output"], "float64").rel_norm}
    moves.update({f"grad {k}": tolerances.compare(kept["grads"][k], g, "float64").rel_norm
                  for k, g in e["grads"].items() if not _zero(g, terms)})
    dtype = d.get("dtype", "float32")
    again = _report(kept, flax, torch32, table, pairs, terms, [], {"dtype": dtype})
    changed = [r["what"] for r, a in zip(report.rows, again.rows) if r["ok"] != a["ok"]]
    report.reference.update(moves=moves, verdict_changes=changed)
    worst = max((k for k in moves if k != "output"), key=moves.get, default=None)
    where = ", ".join(f"{path or 'the top-level module'} ({', '.join(ops)})"
                      for path, ops in steps.items())
    value, grad = (tolerances.TOLERANCES[dtype, k].rel_norm for k in ("value", "grad"))
    report.notes.append(
        f"float32 steps in the torch float64 reference: {where}; kept in float64, the output "
        f"moves by {moves['output']:.1e} (relative error norm; the {dtype} table's bound is "
        f"{value:.0e})"
        + (f", the gradients by up to {moves[worst]:.1e} ({worst}; bound {grad:.0e})"
           if worst else "")
        + (f": the verdict on {', '.join(changed)} differs against the promoted reference "
           f"(judged here: the reference as run)" if changed else
           ": no effect on the verdict (judged against the reference as run)"))
    return report


def _float32_steps(*run) -> dict:
    """{torch module path: names of the ops that ran in float32 or lower inside it, in order}
    from one ``_run_torch`` of ``run`` (float64), recorded by a dispatch mode; a module stack
    kept by global forward hooks names the innermost module running."""
    import torch
    from torch.nn.modules import module as torch_module
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    stack, names, steps = [], {}, {}

    def push(m, _args):
        if not stack:  # the root: the copy _run_torch made
            names.update({id(sub): path for path, sub in m.named_modules()})
        stack.append(names.get(id(m), "?"))

    def pop(_m, _args, _out):
        stack.pop()

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            low = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)
                   and str(t.dtype).removeprefix("torch.") in _LOW]
            op = func.overloadpacket.__name__
            if stack and low and op not in _NO_ARITHMETIC:
                if op == "_to_copy":
                    op = f"to {str(out.dtype).removeprefix('torch.')}"
                ops = steps.setdefault(stack[-1], [])
                ops += [op] if op not in ops else []
            return out

    handles = [torch_module.register_module_forward_pre_hook(push),
               torch_module.register_module_forward_hook(pop)]
    try:
        with Recording():
            _run_torch(*run)
    finally:
        for h in handles:
            h.remove()
    return steps


def _KeepFloat64(torch):
    """A dispatch mode that runs every op in float64: a conversion or a factory asking for
    float32 or lower gets float64, and low-precision operands are promoted (not those an
    in-place op writes to)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    low = tuple(getattr(torch, n) for n in _LOW)

    def up(t):
        return t.to(torch.float64) if isinstance(t, torch.Tensor) and t.dtype in low else t

    class KeepFloat64(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if kwargs.get("dtype") in low:
                kwargs["dtype"] = torch.float64
            if not func._schema.is_mutable:
                args, kwargs = tree_map(up, (args, kwargs))
            return func(*args, **kwargs)

    return KeepFloat64()


# ---------------------------------------------------------------- compare


def compare(torch_factory, flax_factory, mapping, inputs, *, keywords: dict | None = None,
            keyword_grads=(), output=None, dtype: str = "float32", seed: int = 0,
            cotangent_seed: int | None = None) -> PortReport:
    """Draw weights and inputs, run torch float64 (reference) and ``dtype`` (the baseline),
    and the Flax module jitted in ``dtype``; see the module docstring and
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


def _on_grid(value, dtype):
    """Float arrays (through tuples, lists and dicts) rounded to ``dtype``, kept float64; at
    float32 they already are (``_draw``, ``_inputs``)."""
    if dtype == "float32":
        return value

    def leaf(v):
        if isinstance(v, np.ndarray) and v.dtype.kind == "f":
            with np.errstate(over="ignore"):  # a mask's float32 minimum is -inf in float16
                return v.astype(JAX.dtype(dtype)).astype(np.float64)
        return v

    return _leafwise(leaf, value)


# ---------------------------------------------------------------- port fixtures


@dataclass
class _PortFile:
    """A port fixture's members, for ``golden.fixture.to_bytes`` (which calls ``arrays()``)."""

    meta: dict
    members: dict

    def arrays(self) -> dict:
        out = {"meta": np.array(json.dumps(self.meta, sort_keys=True))}
        out.update({k: np.asarray(self.members[k]) for k in sorted(self.members)})
        return out


def freeze(report: PortReport, path, *, torch_factory_spec: str | None = None,
           flax_factory_spec: str | None = None) -> Path:
    """Write what ``report`` drew and the float64 expectations as a port fixture at ``path``."""
    d = report.data
    if not d or "expected" not in d:
        raise ValueError("report should come from compare() or check_port(), got one without "
                         "its drawn data")
    expected = d["expected"]
    pairs = [p for p in d["pairs"] if p[0] in expected["submodules"]]
    sub_inputs = {t: expected["submodule_inputs"][t] for t in dict.fromkeys(t for t, _ in pairs)
                  if t in expected.get("submodule_inputs", {})}
    clash = [k for k in d["weights"] if k.startswith("input.")]
    if clash:
        raise ValueError(f"freeze: torch keys {clash} clash with the input gradients' names")
    output = d.get("output")
    if callable(output):
        raise ValueError(f"freeze: output is a callable ({output!r}), which a port fixture "
                         f"cannot hold; select the output by index or name to freeze it")
    stored = {}
    keywords = {n: _keyword_spec(v, f"keywords/{n}", stored, n)
                for n, v in d.get("keywords", {}).items()}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "seed": d["seed"],
            "dtype": d.get("dtype", "float32"), "keywords": keywords,
            "keyword_grads": list(d.get("keyword_grads", [])), "output": output,
            "mapping": d["mapping"], "params": list(d["weights"]), "inputs": list(d["inputs"]),
            "torch_factory": torch_factory_spec or d.get("torch_factory"),
            "flax_factory": flax_factory_spec or d.get("flax_factory"),
            "submodules": [list(p) for p in pairs],
            "submodule_inputs": list(sub_inputs),
            "shapes": {"output": list(expected["output"].shape),
                       **{f"params/{k}": list(w.shape) for k, w in d["weights"].items()},
                       **{f"inputs/{n}": list(a.shape) for n, a in d["inputs"].items()}}}
    members = {f"inputs/{n}": a.astype(np.float32) if a.dtype.kind == "f" else a
               for n, a in d["inputs"].items()}
    members.update(stored)
    members.update({f"params/{k}": w for k, w in d["weights"].items()})
    members.update({"cotangents/output": d["cotangent"], "expected/output": expected["output"]})
    members.update({f"grads/{k}": g for k, g in expected["grads"].items()})
    members.update({f"submodules/{t}": expected["submodules"][t]
                    for t in dict.fromkeys(t for t, _ in pairs)})
    members.update({f"submodule_inputs/{t}": a for t, a in sub_inputs.items()})
    write_atomic(Path(path), to_bytes(_PortFile(meta, members)))
    return Path(path)


def _keyword_spec(value, member, stored, name):
    """The JSON description of a keyword value, its arrays put in ``stored`` under member
    names "keywords/<name>/<index or key>/..."; a factory is refused (ValueError)."""
    if isinstance(value, np.ndarray):
        stored[member] = value.astype(np.float32) if value.dtype.kind == "f" else value
        return {"array": member}
    if isinstance(value, (tuple, list)):
        return {type(value).__name__: [_keyword_spec(v, f"{member}/{i}", stored, name)
                                       for i, v in enumerate(value)]}
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str) or "/" in k or not k]
        if bad:
            raise ValueError(f"freeze: keywords[{name!r}] has dict keys {bad}; a port fixture "
                             f"holds non-empty string keys without '/'")
        return {"dict": {k: _keyword_spec(v, f"{member}/{k}", stored, name)
                         for k, v in value.items()}}
    if callable(value):
        raise ValueError(f"freeze: keywords[{name!r}] holds a factory ({value!r}), which a "
                         f"port fixture cannot hold; pass arrays (or a nested tuple/list/dict "
                         f"of arrays), or keep checking this port with compare()")
    return {"value": value}


def _keyword_value(spec, members, fail, where):
    """The keyword value a ``_keyword_spec`` describes, float arrays as float64."""
    if not isinstance(spec, dict) or len(spec) != 1:
        fail(f"meta.keywords: {where} should be one of {{array, tuple, list, dict, value}}, "
             f"got {spec!r}")
    (kind, body), = spec.items()
    if kind == "array":
        if body not in members:
            fail(f"meta.keywords: {where} names the member {body!r}, which is absent")
        a = members[body]
        return a.astype(np.float64) if a.dtype.kind == "f" else a
    if kind in ("tuple", "list") and isinstance(body, list):
        items = [_keyword_value(v, members, fail, f"{where}[{i}]") for i, v in enumerate(body)]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict" and isinstance(body, dict):
        return {k: _keyword_value(v, members, fail, f"{where}[{k!r}]") for k, v in body.items()}
    if kind == "value" and isinstance(body, _PLAIN_TYPES):
        return body
    fail(f"meta.keywords: {where} should be one of {{array, tuple, list, dict, value}}, got "
         f"{spec!r}")


def _keyword_members(spec) -> list:
    """The member names a keyword description refers to."""
    (kind, body), = spec.items()
    if kind == "array":
        return [body]
    if kind in ("tuple", "list"):
        return [m for v in body for m in _keyword_members(v)]
    if kind == "dict":
        return [m for v in body.values() for m in _keyword_members(v)]
    return []


def load_port(path) -> dict:
    """{"meta", "inputs", "keywords", "params", "cotangent", "expected"} from a port fixture,
    validated; ``golden.FixtureError`` naming the file and the problem. Never unpickles.
    A format-version-1 file (before dtypes and keywords) reads as float32 without keywords."""
    if not Path(path).is_file():
        raise FixtureError(f"{path}: no such port fixture")
    members = read_members(path)  # the fixtures' bounded reader: no allocation on trust

    def fail(problem):
        raise FixtureError(f"{path}: {problem}")

    meta = _port_meta(members, fail)
    groups = _port_groups(members, meta, fail)
    subs, grads = groups["submodules"], groups["grads"]  # in the orders meta gives
    order = meta["params"] + [f"input.{n}" for n in meta["inputs"] if f"input.{n}" in grads]
    order += [f"input.{n}" for n in meta["keyword_grads"]]
    expected = {"output": members["expected/output"], "grads": {k: grads[k] for k in order},
                "submodules": {t: subs[t] for t in dict.fromkeys(t for t, _ in meta["submodules"])}}
    if meta["format_version"] >= 2:  # version 1 stored no submodule inputs
        expected["submodule_inputs"] = {t: groups["submodule_inputs"][t]
                                        for t in meta["submodule_inputs"]}
    keywords = {n: _keyword_value(spec, members, fail, f"keywords[{n!r}]")
                for n, spec in meta["keywords"].items()}
    return {"meta": meta, "inputs": {n: groups["inputs"][n] for n in meta["inputs"]},
            "keywords": keywords,
            "params": {k: groups["params"][k] for k in meta["params"]},
            "cotangent": members["cotangents/output"], "expected": expected}


def _port_meta(members, fail) -> dict:
    if "meta" not in members:
        fail("no 'meta' member; this is not an attn-parity port fixture")
    try:
        meta = json.loads(str(members["meta"][()]))
    except (json.JSONDecodeError, TypeError, IndexError) as e:
        fail(f"'meta' is not valid JSON ({e})")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fail(f"meta.format should be {FORMAT!r}, got "
             f"{meta.get('format') if isinstance(meta, dict) else meta!r}")
    if meta.get("format_version") not in FORMAT_VERSIONS:
        fail(f"meta.format_version should be one of {list(FORMAT_VERSIONS)} (this attn-parity "
             f"reads those), got {meta.get('format_version')!r}")
    if meta["format_version"] < 3:  # before dtypes, keywords and output selection
        meta.update(dtype="float32", keywords={}, keyword_grads=[], output=None)
    if meta.get("dtype") not in RUN_DTYPES:
        fail(f"meta.dtype should be one of {', '.join(RUN_DTYPES)}, got {meta.get('dtype')!r}")
    output = meta.get("output")
    if not (output is None or isinstance(output, str)
            or (isinstance(output, int) and not isinstance(output, bool))):
        fail(f"meta.output should be null, an index or a name, got {output!r}")
    since_2 = (("submodule_inputs", list),) if meta["format_version"] >= 2 else ()
    for key, kind in (("mapping", dict), ("params", list), ("inputs", list),
                      ("submodules", list), ("shapes", dict), ("keywords", dict),
                      ("keyword_grads", list), *since_2):
        if not isinstance(meta.get(key), kind):
            fail(f"meta.{key} should be a {kind.__name__}, got {meta.get(key)!r}")
    try:
        mapping_lib.parse(meta["mapping"])
    except ValueError as e:
        fail(f"meta.mapping: {e}")
    if sorted(meta["params"]) != sorted(meta["mapping"]):
        fail(f"meta.params should list the mapping's keys, got {meta['params']}")
    if not all(n in meta["keywords"] and "array" in meta["keywords"][n]
               for n in meta["keyword_grads"]):
        fail(f"meta.keyword_grads should name keywords holding an array, got "
             f"{meta['keyword_grads']}")
    stray = [t for t in meta.get("submodule_inputs", []) if t not in
             [p[0] for p in meta["submodules"] if isinstance(p, list) and p]]
    if stray:
        fail(f"meta.submodule_inputs should name torch paths of meta.submodules, got {stray}")
    return meta


def _port_groups(members, meta, fail) -> dict:
    """The members by group, after checking names, shapes and dtypes against meta."""
    keys, names = meta["params"], meta["inputs"]
    floats = [n for n in names if f"inputs/{n}" in members
              and members[f"inputs/{n}"].dtype.kind == "f"]
    required = {"meta", "cotangents/output", "expected/output"}
    required |= {f"inputs/{n}" for n in names} | {f"params/{k}" for k in keys}
    required |= {f"grads/{k}" for k in keys} | {f"grads/input.{n}" for n in floats}
    required |= {f"submodules/{t}" for t, _ in meta["submodules"]}
    required |= {f"grads/input.{n}" for n in meta["keyword_grads"]}
    try:
        required |= {m for spec in meta["keywords"].values() for m in _keyword_members(spec)}
    except (ValueError, AttributeError, TypeError):
        fail(f"meta.keywords should map names to {{array, tuple, list, dict, value}} "
             f"descriptions, got {meta['keywords']!r}")
    required |= {f"submodule_inputs/{t}" for t in meta.get("submodule_inputs", [])}
    missing, extra = sorted(required - set(members)), sorted(set(members) - required)
    if missing or extra:
        fail(f"members do not match meta: missing {missing}, unexpected {extra}")
    for name, shape in meta["shapes"].items():
        if name not in ("output", *(k for k in required if k.startswith(("params/", "inputs/")))):
            fail(f"meta.shapes names {name!r}, which is not a params/ or inputs/ member")
        got = members["expected/output" if name == "output" else name].shape
        if list(got) != shape:
            fail(f"{name} has shape {got}, meta.shapes says {tuple(shape)}")
    groups = {g: {k.split("/", 1)[1]: v for k, v in members.items() if k.startswith(g + "/")}
              for g in ("inputs", "params", "grads", "submodules", "submodule_inputs",
                        "keywords")}
    _check_port_arrays(members, groups, fail)
    return groups


def _check_port_arrays(members, groups, fail) -> None:
    sources = {**groups["params"], **{f"input.{n}": a for n, a in groups["inputs"].items()},
               **{f"input.{n}": a for n, a in groups["keywords"].items()}}
    for n, g in groups["grads"].items():
        if g.shape != sources[n].shape:
            fail(f"grads/{n} has shape {g.shape}, the array it differentiates {sources[n].shape}")
    if members["cotangents/output"].shape != members["expected/output"].shape:
        fail(f"cotangents/output has shape {members['cotangents/output'].shape}, "
             f"expected/output {members['expected/output'].shape}")
    finite = {"cotangents/output": members["cotangents/output"],
              "expected/output": members["expected/output"],
              **{f"{g}/{k}": a for g in ("params", "grads", "submodules", "submodule_inputs")
                 for k, a in groups[g].items()}}
    for name, a in finite.items():
        if a.dtype != np.float64 or not np.all(np.isfinite(a)):
            fail(f"{name} should be finite float64, got {a.dtype}")


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


# ---------------------------------------------------------------- command line


def add_arguments(parser) -> None:
    """The ``compare`` sub-command's options."""
    parser.add_argument("--torch", metavar="SPEC", help="torch module factory, pkg.mod:callable")
    parser.add_argument("--flax", metavar="SPEC", help="Flax NNX module factory, pkg.mod:callable")
    parser.add_argument("--mapping", metavar="SPEC_OR_FILE",
                        help="a JSON file {torch key: [flax path, rule]}, or pkg.mod:NAME of such "
                             "a dict")
    parser.add_argument("--input", metavar="NAME=D1,D2,...", action="append", default=[],
                        help="an input and its shape, in call order (repeatable)")
    parser.add_argument("--keywords", metavar="SPEC",
                        help="pkg.mod:NAME of a dict {name: value} passed to both modules by name "
                             "(shapes, arrays, nested arrays, plain values, factories: the "
                             "keywords= of golden.compare.compare)")
    parser.add_argument("--keyword-grad", metavar="NAME", action="append", default=[],
                        help="a keyword whose gradient is compared too (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn weights and inputs")
    parser.add_argument("--dtype", choices=RUN_DTYPES, default="float32",
                        help="run the Flax module and the torch baseline in this dtype (torch "
                             "float64 stays the reference; default float32)")
    parser.add_argument("--output", metavar="INDEX_OR_NAME",
                        help="the array to judge in what the modules return: an index or a name "
                             "(key or field); default the output, or its first array")
    parser.add_argument("--freeze", metavar="FILE", help="write what was drawn as a port fixture")
    parser.add_argument("--fixture", metavar="FILE",
                        help="check the Flax module against a frozen port fixture instead")
    parser.add_argument("--no-torch", action="store_true",
                        help="with --fixture: leave out the torch float32 baseline column, so "
                             "that torch is neither imported nor needed")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")


def run_cli(args, log=print, error_log=None) -> int:
    """0 when the port passes, 1 when it fails, 2 on a usage error (one line, no traceback,
    through ``error_log``, default ``log``; the command sends it to stderr).
    The current directory is importable, so specs may name the user's own modules."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        report = _cli_report(args)
        if args.freeze:
            freeze(report, args.freeze, torch_factory_spec=args.torch,
                   flax_factory_spec=args.flax)
        if args.json:
            text = json.dumps({**SCHEMA, **report.to_json()}, indent=1, allow_nan=False)
            write_atomic(Path(args.json), (text + "\n").encode("utf-8"))
    except (ValueError, OSError) as e:  # FixtureError included
        (error_log or log)(f"attn-parity compare: error: {str(e).splitlines()[0]}")
        return 2
    log(report.text())
    if args.freeze:
        log(f"froze the port fixture {args.freeze}")
    return 0 if report.ok else 1


def _cli_report(args) -> PortReport:
    no_torch = getattr(args, "no_torch", False)
    if no_torch and not args.fixture:
        raise ValueError("--no-torch goes with --fixture FILE (compare without a fixture runs "
                         "torch float64 as the reference)")
    if no_torch and args.torch:
        raise ValueError(f"--no-torch leaves torch out, got --torch {args.torch!r} as well")
    if args.fixture:
        given = [o for o, v in (("--dtype", args.dtype != "float32"), ("--output", args.output),
                                ("--keywords", getattr(args, "keywords", None)),
                                ("--keyword-grad", getattr(args, "keyword_grad", None)))
                 if v]
        if given:
            raise ValueError(f"{', '.join(given)}: a port fixture records its own; leave them "
                             f"out with --fixture")
        return check_port(args.fixture, args.flax and resolve_spec(args.flax),
                          False if no_torch else args.torch and resolve_spec(args.torch))
    absent = [o for o, v in (("--torch", args.torch), ("--flax", args.flax),
                             ("--mapping", args.mapping), ("--input", args.input)) if not v]
    if absent:
        raise ValueError(f"compare needs {', '.join(absent)} (or --fixture FILE)")
    output = args.output
    if output is not None and output.lstrip("-").isdigit():
        output = int(output)
    return compare(_factory(args.torch), _factory(args.flax), _cli_mapping(args.mapping),
                   _cli_inputs(args.input), seed=args.seed, dtype=args.dtype, output=output,
                   keywords=_cli_keywords(getattr(args, "keywords", None)),
                   keyword_grads=tuple(getattr(args, "keyword_grad", None) or ()))


def _cli_keywords(spec):
    """The dict named by ``--keywords pkg.mod:NAME`` (None when not given)."""
    if spec is None:
        return None
    table = resolve_spec(spec)
    if not isinstance(table, dict):
        raise ValueError(f"--keywords {spec!r} should name a dict {{name: value}}, got "
                         f"{type(table).__name__}")
    return table


def _factory(spec):
    obj = resolve_spec(spec)
    if not callable(obj):
        raise ValueError(f"spec {spec!r} should name a callable, got {type(obj).__name__}")
    return obj


def _cli_mapping(value):
    """A JSON file's path, or a "pkg.mod:NAME" naming a dict."""
    if Path(value).exists() or not SPEC.match(value):
        return mapping_lib.parse(value)
    table = resolve_spec(value)
    if not isinstance(table, dict):
        raise ValueError(f"--mapping {value!r} should name a dict, got {type(table).__name__}")
    return table


def _cli_inputs(items) -> dict:
    """{name: shape} from ["x=2,5,8", ...], in order."""
    out = {}
    for item in items:
        name, _, dims = item.partition("=")
        try:
            shape = tuple(int(d) for d in dims.split(","))
        except ValueError:
            shape = ()
        if not name.isidentifier() or not shape or min(shape) <= 0 or name in out:
            raise ValueError(f"--input should be NAME=D1,D2,... with positive sizes and a new "
                             f"name, got {item!r}")
        out[name] = shape
    return out
