"""Any implementation against the golden suite: the runner contract made one line for the
common cases (see ``golden.runners`` for the contract itself).

    from_function(fn, framework)        a function of the core's signature, in NumPy, PyTorch
                                        or JAX: it runs the core's fixtures
    from_module(factory, framework,     a module class per variant, its weights set through a
                mapping=...)            table from the neutral layout (golden.specification.mapping)
    combine(runner, ...)                the first runner that supports a fixture runs it
    load("pkg.mod:name")                what ``attn-parity check --impl`` takes

A runner raises :class:`NotSupported` for a fixture it cannot run (a variant it lacks, an
argument it does not take, a dtype its framework has not); the check reports those apart from
failures. A ``NotImplementedError`` raised by the implementation a Runner wraps is taken as
NotSupported, its message the reason. NumPy runners are forward-only (no autodiff): output and
weights are checked, not gradients. A function that returns no attention weights is checked on
its output, and its gradients on the loss Σ output ⊙ dO alone (``"loss": "output"`` in the
result).

Frameworks are imported only when a runner of theirs runs.
"""

from __future__ import annotations

import importlib
import inspect
import re
from functools import partial

import numpy as np

from golden.specification import implementations, variants
from golden.specification import mapping as mappings
from golden.runners.frameworks import ADAPTERS, JAX, NUMPY, TORCH

CORE = variants.SDPA
FRAMEWORKS = ("numpy", "torch", "jax")
_CONFIG_DEFAULTS = {a.name: a.default for a in variants.get(CORE).args}


class NotSupported(Exception):
    """The runner cannot run this fixture; the message says why."""


def pending_options(fixture) -> list[str]:
    """The options the fixture sets that its description marks pending (Arg.pending:
    golden.reference has them, the twins' modules do not take them yet), in its order."""
    from golden.specification import variants

    described = variants.lookup(fixture.variant)
    return [a.name for a in getattr(described, "args", ()) if a.pending
            and a.name in fixture.config]


def refuse_pending(fixture, framework: str) -> None:
    """NotSupported when the fixture sets a pending option (``pending_options``), naming them."""
    from golden.specification import variants

    pending = pending_options(fixture)
    if pending:
        raise NotSupported(f"{', '.join(pending)}: {framework}'s "
                           f"{variants.lookup(fixture.variant).class_name} does not take it "
                           f"yet (golden.reference has it)")


class Runner:
    """A named runner: ``runner(fixture, dtype) -> result`` (raises NotSupported)."""

    def __init__(self, name, framework, run, unsupported=None):
        self.name, self.framework = name, framework
        self._run, self._unsupported = run, unsupported or (lambda fixture, dtype: None)

    def unsupported(self, fixture, dtype) -> str | None:
        """Why the runner cannot run the fixture at ``dtype``, or None."""
        return self._unsupported(fixture, dtype)

    def __call__(self, fixture, dtype):
        reason = self.unsupported(fixture, dtype)
        if reason:
            raise NotSupported(reason)
        try:
            with implementations.record() as ran:
                result = self._run(fixture, dtype)
        except NotImplementedError as e:  # the implementation lacks a feature: it says which
            raise NotSupported(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from e
        if ran and "core" not in result:  # it ran this project's core: say which one
            result = {**result, "core": implementations.names(ran)}
        return result

    def __repr__(self) -> str:
        return f"<runner {self.name} ({self.framework})>"


def _framework(framework, dtypes):
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework should be one of {', '.join(FRAMEWORKS)}, "
                         f"got {framework!r}")
    dtypes = tuple(ADAPTERS[framework].dtypes if dtypes is None else dtypes)
    bad = [d for d in dtypes if d not in ADAPTERS[framework].dtypes]
    if bad:
        raise ValueError(f"dtypes should be drawn from {', '.join(ADAPTERS[framework].dtypes)} for "
                         f"{framework}, got {', '.join(bad)}")
    return dtypes


def _dtype_check(name, framework, dtypes):
    def check(fixture, dtype):
        if dtype not in dtypes:
            return f"{name} runs {', '.join(dtypes)} ({framework}), not {dtype}"
        return None
    return check


# ---- a function of the core's signature -------------------------------------------------------

def core_arguments(fixture) -> tuple[dict, dict]:
    """(the query, key and value; every other argument the fixture sets): the inputs present
    and the configuration values that differ from the core's defaults."""
    arrays = {n: fixture.inputs[n] for n in ("query", "key", "value")}
    keywords = {n: a for n, a in fixture.inputs.items() if n not in arrays}
    keywords.update({k: (tuple(v) if isinstance(v, list) else v)
                     for k, v in fixture.config.items() if v != _CONFIG_DEFAULTS.get(k)})
    return arrays, keywords


def _takes(fn, keywords=None) -> tuple[set | None, bool]:
    """(the keyword names ``fn`` takes, None for any; whether it takes return_weights).
    ``keywords``, when given, is the answer; else ``fn``'s signature, that of the function it
    wraps when it has ``__wrapped__`` (functools.wraps). A ``**kwargs`` means any."""
    if keywords is not None:
        return set(keywords), "return_weights" in keywords
    try:
        params = inspect.signature(fn, follow_wrapped=True).parameters  # bound: no self
    except (TypeError, ValueError):  # a builtin without a signature (torch's F.sdpa): any
        return None, False  # keyword but return_weights, which it would name in its signature
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None, "return_weights" in params
    names = {n for n, p in params.items() if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                         inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return names, "return_weights" in names


def _keyword_names(keywords):
    """``from_function``'s ``keywords``: None, or a tuple of names (ValueError otherwise)."""
    if keywords is None:
        return None
    names = tuple(keywords) if not isinstance(keywords, str) else None
    if names is None or not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise ValueError(f"keywords should be an iterable of keyword names (str), "
                         f"got {keywords!r}")
    return names


_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")


def _refused_keyword(error: TypeError, passed) -> str | None:
    """The keyword among ``passed`` that ``error`` says the function does not take, or None."""
    match = _UNEXPECTED.search(str(error))
    return match.group(1) if match and match.group(1) in passed else None


def from_function(fn, framework: str, *, name: str | None = None, dtypes=None,
                  keywords=None) -> Runner:
    """A runner of the core's fixtures through ``fn(query, key, value, **keywords)``, where
    keywords are those the fixture sets (mask, bias, is_causal, scale, softcap,
    local_window_size, attention_chunk_size, query_offset, query_seq_lengths,
    key_value_seq_lengths, sinks, dropout_rate, dropout_mask), each passed only when set, and
    ``return_weights=True`` when ``fn`` takes it (it then returns ``(output, weights)``).
    Arrays are ``framework``'s ("numpy", "torch", "jax") in the run's dtype; masks bool,
    offsets and lengths int32. ``dtypes`` (default: every dtype the framework has) are the
    dtypes it runs; a fixture at another is not supported.

    A fixture that sets a keyword ``fn`` does not take is not supported. Which keywords it
    takes: ``keywords`` (an iterable of names) when given, else ``fn``'s signature, followed
    through ``__wrapped__`` (a functools.wraps decorator). When that signature has ``**kwargs``
    (or there is none: a builtin such as torch's F.scaled_dot_product_attention) and no
    ``keywords`` is given, every keyword looks taken: a TypeError "unexpected keyword argument
    'x'" for a keyword x the fixture passed then makes the row not supported too."""
    if not callable(fn):
        raise ValueError(f"fn should be a callable, got {type(fn).__name__}")
    dtypes = _framework(framework, dtypes)
    name = name or getattr(fn, "__qualname__", repr(fn))
    takes, weights = _takes(fn, _keyword_names(keywords))
    by_dtype = _dtype_check(name, framework, dtypes)

    def unsupported(fixture, dtype):
        if fixture.variant != CORE:
            return f"{name} is a function of the core's signature; {fixture.variant} is a module"
        missing = [] if takes is None else sorted(set(core_arguments(fixture)[1]) - takes)
        if missing:
            return f"{name} does not take {', '.join(missing)}"
        return by_dtype(fixture, dtype)

    def call(arrays, keywords):
        try:
            out = fn(*arrays.values(), **keywords,
                     **({"return_weights": True} if weights else {}))
        except TypeError as e:
            refused = None if takes is not None else _refused_keyword(e, keywords)
            if refused:
                raise NotSupported(f"{name} does not take {refused} (TypeError: {e})") from e
            raise
        return out if weights else (out, None)

    run = partial(_RUN[framework], call)
    return Runner(name, framework, lambda fixture, dtype: run(fixture, dtype,
                                                              *core_arguments(fixture)),
                  unsupported)


# ---- a module per variant, weights through a mapping ------------------------------------------

def from_module(factory, framework: str, *, mapping, name: str | None = None,
                dtypes=None) -> Runner:
    """A runner of the module variants' fixtures: ``factory(variant, config)`` returns a module
    (None: not supported) for the variant's complete configuration (every constructor
    argument, defaults filled in), ``mapping`` (a dict, or ``mapping(variant, config)``
    returning one) sends each neutral parameter name to the module's attribute path with a
    layout rule (golden.specification.mapping): ``{"W_query": ("q_proj.weight", "T"), "b_query":
    "q_proj.bias"}``. The module is called like this project's modules (inputs, mask,
    keywords, ``return_weights=True`` when it takes it), in training mode when the fixture has
    a dropout mask (``.train()``/``.eval()`` where the module has them)."""
    if not callable(factory):
        raise ValueError(f"factory should be a callable (variant, config) -> module, "
                         f"got {type(factory).__name__}")
    dtypes = _framework(framework, dtypes)
    if not (callable(mapping) or isinstance(mapping, dict)):
        raise ValueError(f"mapping should be a dict {{neutral name: (path, rule)}} or a callable "
                         f"(variant, config) -> dict, got {type(mapping).__name__}")
    if isinstance(mapping, dict) and mapping:
        mappings.parse(mapping)  # a malformed table fails here, not at the first fixture
    name = name or getattr(factory, "__qualname__", repr(factory))
    by_dtype = _dtype_check(name, framework, dtypes)
    built = {}

    def module_for(fixture):
        key = (fixture.variant, repr(sorted(fixture.config.items())))
        if key not in built:
            built[key] = factory(fixture.variant, full_config(fixture))
        return built[key]

    def unsupported(fixture, dtype):
        if not variants.lookup(fixture.variant).is_module:
            return f"{name} runs module variants; {fixture.variant} is the core"
        if module_for(fixture) is None:
            return f"{name} builds no {fixture.variant} with {fixture.config}"
        return by_dtype(fixture, dtype)

    def run(fixture, dtype):
        module = factory(fixture.variant, full_config(fixture))  # fresh: no state carried over
        table = mapping(fixture.variant, full_config(fixture)) if callable(mapping) else mapping
        table = {n: r for n, r in (mappings.parse(table) if table else {}).items()
                 if n in fixture.params}  # a variant without parameters maps nothing
        missing = sorted(set(fixture.params) - set(table))
        if missing:
            raise ValueError(f"mapping should send every parameter of the fixture to the module; "
                             f"missing {', '.join(missing)}")
        return _MODULE_RUN[framework](module, table, fixture, dtype)

    return Runner(name, framework, run, unsupported)


def full_config(fixture) -> dict:
    """The fixture's module configuration with every default filled in (a copy)."""
    return variants.lookup(fixture.variant).config(dict(fixture.config))


def combine(*runners, name: str | None = None) -> Runner:
    """One runner from several: the first that supports a fixture runs it."""
    if not runners:
        raise ValueError("combine needs at least one runner")

    def unsupported(fixture, dtype):
        reasons = [r.unsupported(fixture, dtype) for r in runners]
        return None if any(x is None for x in reasons) else "; ".join(reasons)

    def run(fixture, dtype):
        return next(r for r in runners if r.unsupported(fixture, dtype) is None)(fixture, dtype)

    frameworks = sorted({r.framework for r in runners})
    return Runner(name or " + ".join(r.name for r in runners), "/".join(frameworks), run,
                  unsupported)


SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def resolve_spec(spec: str):
    """The object named by "package.module:name" (``name`` may be dotted: "mod:Class.make");
    ValueError saying what was wrong."""
    if not isinstance(spec, str) or not SPEC.match(spec):
        raise ValueError(f"spec should be 'package.module:name', got {spec!r}")
    module_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"spec {spec!r}: cannot import {module_name!r} ({e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"spec {spec!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load(spec: str):
    """The runner named by "package.module:attribute" (a Runner, or any callable of the
    contract ``(fixture, dtype) -> dict``), or by "package.module" whose ``run_fixture`` is
    one. ValueError saying what was wrong."""
    if isinstance(spec, str) and spec and ":" not in spec:
        spec = f"{spec}:run_fixture"
    target = resolve_spec(spec)
    if not callable(target):
        raise ValueError(f"spec {spec!r} should name a runner (fixture, dtype) -> dict, got "
                         f"{type(target).__name__}")
    return as_runner(target, spec.removesuffix(":run_fixture"))


def as_runner(runner, name=None) -> Runner:
    """``runner`` itself if it is a Runner, else a Runner around a callable of the contract;
    ValueError for anything else."""
    if isinstance(runner, Runner):
        return runner
    if not callable(runner):
        raise ValueError(f"implementation should be a runner (fixture, dtype) -> dict, got "
                         f"{type(runner).__name__}")
    return Runner(name or getattr(runner, "__qualname__", repr(runner)),
                  getattr(runner, "framework", ""), runner)


# ---- the frameworks (their adapters: golden.runners.frameworks)
# ---------------------------------------

def _result(adapter, out, weights, grads, dtype):
    result = {"output": adapter.numpy(out), "dtype": dtype}
    if weights is not None:
        result["weights"] = adapter.numpy(weights)
    if grads is not None:
        result["grads"] = grads
        if weights is None:
            result["loss"] = "output"  # the gradients of Σ output ⊙ dO alone
    return result


def _run_numpy_call(call, fixture, dtype, arrays, keywords):
    out, weights = call(NUMPY.leaves(arrays, dtype), _keywords(NUMPY, keywords, dtype))
    return _result(NUMPY, out, weights, None, dtype)


def _keywords(adapter, keywords, dtype):
    """The arrays among ``keywords`` in the framework (floats in ``dtype``), the rest as is."""
    arrays = adapter.leaves({n: a for n, a in keywords.items() if isinstance(a, np.ndarray)},
                            dtype)
    return {n: arrays.get(n, a) for n, a in keywords.items()}


def _run_torch(call, fixture, dtype, arrays, keywords):
    arrays, keywords = TORCH.leaves(arrays, dtype), _keywords(TORCH, keywords, dtype)
    out, weights = call(arrays, keywords)
    TORCH.loss(fixture.cotangents, out, weights, dtype).backward()
    grads = {n: TORCH.numpy(t.grad) for n, t in {**arrays, **keywords}.items()
             if getattr(t, "requires_grad", False)}
    return _result(TORCH, out, weights, grads, dtype)


def _jax_split(arrays, keywords, dtype):
    """(float arrays, other arrays, static keywords) as JAX arrays of ``dtype``."""
    every = {**arrays, **{n: a for n, a in keywords.items() if isinstance(a, np.ndarray)}}
    floats = JAX.leaves({n: a for n, a in every.items() if a.dtype.kind == "f"}, dtype)
    others = JAX.leaves({n: a for n, a in every.items() if a.dtype.kind != "f"}, dtype)
    static = {n: a for n, a in keywords.items() if not isinstance(a, np.ndarray)}
    return floats, others, static


def _run_jax(call, fixture, dtype, arrays, keywords):
    import jax

    with JAX.float64(dtype == "float64"):
        floats, others, static = _jax_split(arrays, keywords, dtype)
        names = list(arrays)

        def loss(floats, others):
            every = {**floats, **others}
            out, weights = call({n: every[n] for n in names},
                                {**{n: every[n] for n in every if n not in names}, **static})
            return JAX.loss(fixture.cotangents, out, weights, dtype), (out, weights)

        grads, (out, weights) = jax.jit(jax.grad(loss, has_aux=True))(floats, others)
        return _result(JAX, out, weights, {n: JAX.numpy(g) for n, g in grads.items()}, dtype)


_RUN = {"numpy": _run_numpy_call, "torch": _run_torch, "jax": _run_jax}


# ---- modules ----------------------------------------------------------------------------------

def _module_call(module, fixture, arrays):
    """The module on the fixture's inputs, as this project's modules are called; (out, weights
    or None)."""
    args, kwargs = variants.lookup(fixture.variant).call_args(arrays)
    takes, weights = _takes(getattr(module, "forward", module))  # torch: the forward's signature
    out = module(*args, **kwargs, **({"return_weights": True} if weights else {}))
    return out if weights else (out, None)


def _set_mode(module, fixture):
    train = "dropout_mask" in fixture.inputs
    method = getattr(module, "train" if train else "eval", None)
    if callable(method):
        method()


def _place(module, path):
    """(the object holding the last part of ``path``, that part)."""
    parts = mappings.split_path(path)
    obj = module
    for part in parts[:-1]:
        obj = obj[part] if isinstance(part, int) else getattr(obj, part)
    return obj, parts[-1]


def _get(module, path):
    obj, last = _place(module, path)
    return obj[last] if isinstance(last, int) else getattr(obj, last)


def _check_shape(neutral, path, rule, value, current):
    shape = getattr(current, "shape", None)
    if shape is not None and tuple(shape) != value.shape:
        raise ValueError(f"mapping: {neutral} -> {path}: rule {rule} gives shape {value.shape}, "
                         f"the module's has shape {tuple(shape)}")


def _module_numpy(module, table, fixture, dtype):
    for neutral, (path, rule) in table.items():
        value = rule.apply(fixture.params[neutral]).astype(dtype)
        obj, last = _place(module, path)
        current = obj[last] if isinstance(last, int) else getattr(obj, last, None)
        _check_shape(neutral, path, rule, value, current)
        if isinstance(last, int):
            obj[last] = value
        else:
            setattr(obj, last, value)
    _set_mode(module, fixture)
    arrays = NUMPY.leaves(fixture.inputs, dtype)
    out, weights = _module_call(module, fixture, arrays)
    return _result(NUMPY, out, weights, None, dtype)


def _module_torch(module, table, fixture, dtype):
    import torch

    module = module.to(TORCH.dtype(dtype))
    params = {}
    with torch.no_grad():
        for neutral, (path, rule) in table.items():
            param = module.get_parameter(path)
            value = rule.apply(fixture.params[neutral])
            _check_shape(neutral, path, rule, value, param)
            param.copy_(torch.from_numpy(value))
            params[neutral] = param
    _set_mode(module, fixture)
    module.zero_grad(set_to_none=True)
    arrays = TORCH.leaves(fixture.inputs, dtype)
    out, weights = _module_call(module, fixture, arrays)
    TORCH.loss(fixture.cotangents, out, weights, dtype).backward()
    grads = {n: TORCH.numpy(t.grad) for n, t in arrays.items() if t.requires_grad}
    for neutral, param in params.items():
        path, rule = table[neutral]
        grads[neutral] = (None if param.grad is None else
                          rule.inverse(TORCH.numpy(param.grad), fixture.params[neutral].shape))
    return _result(TORCH, out, weights, grads, dtype)


def _module_jax(module, table, fixture, dtype):
    with JAX.float64(dtype == "float64"):
        return _module_jax_x64(module, table, fixture, dtype)


def _module_jax_x64(module, table, fixture, dtype):
    import jax
    from flax import nnx

    for neutral, (path, rule) in table.items():
        variable = _get(module, path)
        value = rule.apply(fixture.params[neutral])
        if not isinstance(variable, nnx.Variable):
            raise ValueError(f"mapping: {neutral} -> {path}: the module's {path} should be an "
                             f"nnx.Param, got {type(variable).__name__}")
        _check_shape(neutral, path, rule, value, variable.get_value())
        variable.set_value(JAX.array(value, dtype))
    _set_mode(module, fixture)
    floats, others, _ = _jax_split(fixture.inputs, {}, dtype)
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(floats, params):
        merged = nnx.merge(graphdef, params, rest)
        out, weights = _module_call(merged, fixture, {**floats, **others})
        return JAX.loss(fixture.cotangents, out, weights, dtype), (out, weights)

    (g_in, g_params), (out, weights) = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(
        floats, params)
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(g_params)}
    grads = {n: JAX.numpy(g) for n, g in g_in.items()}
    for neutral, (path, rule) in table.items():
        g = flat.get(path)
        grads[neutral] = None if g is None else rule.inverse(
            JAX.numpy(g.get_value() if isinstance(g, nnx.Variable) else g),
            fixture.params[neutral].shape)
    return _result(JAX, out, weights, grads, dtype)


_MODULE_RUN = {"numpy": _module_numpy, "torch": _module_torch, "jax": _module_jax}
