"""What both modules are called with, and what is judged, for ``golden.compare``.

The drawn weights and inputs (N(0, 1) rounded to float32, or to the run's dtype: ``_on_grid``),
the keyword inputs (shapes, arrays, nested arrays, plain values, factories) converted for each
framework, the output selection (index, name or callable through tuples, dicts, ``ModelOutput``s
and dataclasses), and the checks of those arguments and of the run's dtype (``RUN_DTYPES``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from golden.runners.frameworks import JAX, TORCH


RUN_DTYPES = ("float32", "bfloat16", "float16")  # what compare(dtype=...) runs the port in


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
