"""The mapping of ``golden.compare``: torch state-dict key -> (Flax parameter path, rule).

``neutral`` composes one from two tables that map the neutral layout (y = x W + b, W of shape
(in, out)) to each module; ``_validated`` checks a mapping against both modules' parameters;
``_pairs`` lists the paired submodules, those owning a mapped parameter on each side.
"""

from __future__ import annotations

import numpy as np

from golden.specification import mapping as mapping_lib


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
