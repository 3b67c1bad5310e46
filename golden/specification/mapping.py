"""Weight mappings between layouts: which array of one module is which array of another, and
the transpose/reshape rule that turns one layout into the other.

A mapping is a table ``{source name: (target path, rule)}`` (or ``{source: target}`` when the
layouts agree). Names and paths are dotted: ``"q_proj.weight"`` (a torch state-dict key),
``"query.kernel"`` or ``"heads.0.kernel"`` (a Flax NNX attribute path; digits index lists).
A rule is a sequence of steps, applied in order from the source layout to the target layout:

    "T"                    reverse the axes (for a matrix, the transpose: nn.Linear's (out, in)
                           weight <-> the neutral (in, out))
    "transpose(1,0,2)"     permute the axes
    "reshape(8,2,4)"       reshape (one -1 allowed): the neutral (E, H·Dh) <-> Flax
                           nnx.MultiHeadAttention's (E, H, Dh)

written as one string with steps separated by ";" (``"T;reshape(8,2,4)"``) or as a list. Every
step is a permutation of the elements, so a gradient goes back through the same rule inverted
(``Rule.inverse``). NumPy only: the frameworks' path lookups live in ``golden.runners.adapt``;
the arrays a mapping moves are read into NumPy by ``_numpy`` (NumPy, JAX or torch arrays, torch
without importing it), which the converters (golden.convert, golden.hf) share.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_STEP = re.compile(r"^\s*(T|transpose\(([-\d,\s]*)\)|reshape\(([-\d,\s]+)\))\s*$")


@dataclass(frozen=True)
class Rule:
    """Layout steps from a source array to a target array; ``()`` is the identity."""

    steps: tuple = ()  # ("T",), ("transpose", axes), ("reshape", shape)

    @classmethod
    def parse(cls, rule) -> Rule:
        """A rule from None, "", "T", "reshape(8,2,4)", "T;reshape(8,2,4)" or a list of those."""
        if isinstance(rule, Rule):
            return rule
        if rule is None or rule == "":
            return cls()
        if not isinstance(rule, (str, list, tuple)):
            raise TypeError(f"rule should be None, a string such as 'T;reshape(8,2,4)' or a "
                            f"list of steps, got {type(rule).__name__} {rule!r}")
        parts = rule.split(";") if isinstance(rule, str) else list(rule)
        steps = []
        for part in parts:
            m = _STEP.match(str(part)) if isinstance(part, str) else None
            if m is None:
                raise ValueError(f"rule step should be 'T', 'transpose(axes)' or "
                                 f"'reshape(shape)', got {part!r} in {rule!r}")
            if m.group(1) == "T":
                steps.append(("T",))
            elif m.group(2) is not None:
                steps.append(("transpose", _ints(m.group(2))))
            else:
                shape = _ints(m.group(3))
                if sum(d == -1 for d in shape) > 1 or any(d < -1 or d == 0 for d in shape):
                    raise ValueError(f"reshape should have positive sizes and at most one -1, "
                                     f"got {part!r}")
                steps.append(("reshape", shape))
        return cls(tuple(steps))

    def __str__(self) -> str:
        return ";".join("T" if s[0] == "T" else f"{s[0]}({','.join(map(str, s[1]))})"
                        for s in self.steps) or "="

    def shapes(self, shape) -> list[tuple]:
        """The array's shape before each step and after the last; ValueError if a step does not
        fit the shape."""
        chain = [tuple(shape)]
        for step in self.steps:
            s = chain[-1]
            if step[0] == "T":
                chain.append(s[::-1])
            elif step[0] == "transpose":
                if sorted(step[1]) != list(range(len(s))):
                    raise ValueError(f"rule {self}: transpose{step[1]} does not permute the "
                                     f"{len(s)} axes of shape {s}")
                chain.append(tuple(s[a] for a in step[1]))
            else:
                chain.append(_reshaped(self, s, step[1]))
        return chain

    def target_shape(self, shape) -> tuple:
        return self.shapes(shape)[-1]

    def apply(self, array):
        """The source array in the target layout (a NumPy copy, never a view of the input)."""
        a = np.asarray(array)
        for step, s in zip(self.steps, self.shapes(a.shape)):
            if step[0] == "T":
                a = a.T
            elif step[0] == "transpose":
                a = a.transpose(step[1])
            else:
                a = a.reshape(_reshaped(self, s, step[1]))
        return np.array(a)

    def inverse(self, array, source_shape):
        """A target-layout array (a gradient, say) back in the layout of ``source_shape``."""
        chain = self.shapes(source_shape)
        a = np.asarray(array)
        if a.shape != chain[-1]:
            raise ValueError(f"rule {self}: array shape should be {chain[-1]} (from source shape "
                             f"{tuple(source_shape)}), got {a.shape}")
        for step, before in zip(reversed(self.steps), reversed(chain[:-1])):
            if step[0] == "T":
                a = a.T
            elif step[0] == "transpose":
                a = a.transpose(np.argsort(step[1]))
            else:
                a = a.reshape(before)
        return np.array(a)


def _ints(text) -> tuple:
    return tuple(int(t) for t in text.replace(" ", "").split(",") if t)


def _reshaped(rule, shape, want) -> tuple:
    size = math.prod(shape)
    known = math.prod(d for d in want if d != -1)
    out = tuple(size // known if d == -1 else d for d in want)
    if math.prod(out) != size or (-1 in want and size % known):
        raise ValueError(f"rule {rule}: cannot reshape shape {tuple(shape)} ({size} elements) "
                         f"to {want}")
    return out


def _numpy(array) -> np.ndarray:
    """A NumPy copy of a NumPy, JAX or torch array (torch's bfloat16 as float32, exactly)."""
    if hasattr(array, "detach"):  # torch, without importing it (this is the bottom layer)
        array = array.detach().cpu()
        array = (array.float() if str(array.dtype) == "torch.bfloat16" else array).numpy()
    return np.array(array)


def split_path(path: str) -> tuple:
    """("heads", 0, "kernel") from "heads.0.kernel": digits index lists."""
    if not isinstance(path, str) or not path or any(not p for p in path.split(".")):
        raise ValueError(f"path should be dotted names like 'query.kernel', got {path!r}")
    return tuple(int(p) if p.isdigit() else p for p in path.split("."))


def parse(table) -> dict:
    """{source: (target path, Rule)} from a dict whose values are a target, a (target, rule)
    pair, or {"to": target, "rule": rule}; or from a JSON file holding such a dict."""
    if isinstance(table, (str, Path)):
        try:
            table = json.loads(Path(table).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"mapping should be a JSON file of {{source: [target, rule]}}, "
                             f"could not read {str(table)!r}: {e}") from None
    if not isinstance(table, dict) or not table:
        raise ValueError(f"mapping should be a non-empty dict {{source: target or (target, "
                         f"rule)}}, got {type(table).__name__}")
    out = {}
    for source, value in table.items():
        if isinstance(value, dict):
            target, rule = value.get("to"), value.get("rule")
        elif isinstance(value, (tuple, list)) and len(value) == 2:
            target, rule = value
        else:
            target, rule = value, None
        split_path(target)
        out[source] = (target, Rule.parse(rule))
    targets = [t for t, _ in out.values()]
    if len(set(targets)) != len(targets):
        raise ValueError(f"mapping should send each source to a different target, got "
                         f"{sorted(t for t in targets if targets.count(t) > 1)} more than once")
    return out


def to_json(table) -> dict:
    """The JSON-ready form of a parsed table: {source: [target, rule string]}."""
    return {s: [t, "" if not r.steps else str(r)] for s, (t, r) in parse(table).items()}


def submodule(path: str) -> str:
    """The module that owns a parameter: "q_proj" for "q_proj.weight" ("" at the top)."""
    return path.rpartition(".")[0]
