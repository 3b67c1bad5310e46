"""Freezing for ``golden.compare``: a port fixture holds what ``compare`` drew and the float64
expectations (the container of ``golden.specification.fixture``: a zip of ``.npy`` members and a
JSON ``meta``, never pickled). ``freeze`` writes one, ``load_port`` reads and validates one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from golden.specification import mapping as mapping_lib
from golden.compare.calls import _PLAIN_TYPES, RUN_DTYPES
from golden.compare.report import PortReport
from golden.specification.fixture import FixtureError, read_members, to_bytes, write_atomic


FORMAT = "attn-parity-port"
FORMAT_VERSION = 3
# 2: the paired submodules' inputs (meta "submodule_inputs", members submodule_inputs/<torch
# path>), which locate a divergence between two submodules
# 3: the run's dtype, keyword inputs (meta "keywords", members keywords/<name>/...), the
# keywords differentiated ("keyword_grads") and the output selection ("output"); versions 1
# and 2 are still read, as float32 runs without keywords (version 1: located by the
# submodules' outputs alone)
FORMAT_VERSIONS = (1, 2, 3)


@dataclass
class _PortFile:
    """A port fixture's members, for ``golden.specification.fixture.to_bytes`` (which calls
    ``arrays()``)."""

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
