"""Rebuild every fixture from ``golden.specification.cases.CASES`` with the reference in exact
arithmetic (``golden.reference.exact_arithmetic``: the same bytes on every machine).

``python -m golden`` or ``attn-parity regenerate`` writes, then ``MANIFEST.json`` (sha256 of
every file, the case and seed, format version, NumPy version) last; ``--check`` compares both in
memory and exits non-zero on any difference. Unchanged cases produce byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from golden import reference

from golden.specification import variants
from golden.specification.cases import CASES, Case
from golden.specification.fixture import (
    FIXTURE_DIR,
    MANIFEST_NAME,
    Fixture,
    is_temporary,
    manifest_bytes,
    manifest_entry,
    to_bytes,
    write_atomic,
)


def draw(spec, rng):
    """One input array from its spec (see golden.specification.cases)."""
    if spec[0] == "values":
        return np.array(spec[1], dtype=spec[2])
    kind, shape = spec[0], tuple(spec[1])
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "ints":
        return rng.integers(-spec[2], spec[2] + 1, shape).astype(np.float32)
    if kind == "mask":
        mask = rng.random(shape) < spec[2]
        for row in spec[3]:
            mask[row] = False
        return mask
    if kind == "keep":
        return rng.random(shape) >= spec[2]
    if kind == "grid":
        return to_grid(rng.standard_normal(shape))
    raise ValueError(f"unknown input spec kind {kind!r} in {spec!r}")


def to_grid(a):
    """Round to a multiple of 1/64 in [-4, 4]: at most 8 significant bits, exact in bfloat16."""
    return (np.clip(np.round(a * 64), -256, 256) / 64).astype(np.float32)


def draw_params(variant, config, rng, grid=False):
    """Weights N(0, 1/fan_in) and biases N(0, 1), rounded to float32 (or to the grid), in sorted
    name order."""
    shapes = sorted(variants.lookup(variant).param_shapes(config).items())
    params = {name: rng.standard_normal(shape) / np.sqrt(shape[-2] if name.startswith("W_") else 1)
              for name, shape in shapes}
    return {n: to_grid(a) if grid else a.astype(np.float32) for n, a in params.items()}


def build(case: Case) -> Fixture:
    """Draw the case's inputs and cotangents, run the reference forward and backward."""
    rng = np.random.default_rng(case.seed)
    inputs = {name: draw(spec, rng) for name, spec in case.inputs.items()}
    low = {"bfloat16", "float16"} & set(case.dtypes)
    params = draw_params(case.variant, case.config, rng, grid=bool(low))
    params.update({n: np.array(v, dtype=np.float32) for n, v in case.fixed.items()})
    forward, backward = reference.pair(case.variant)
    # the same bits on every machine (golden.specification.exact)
    with reference.exact_arithmetic():
        out, weights, saved = forward(case.config, inputs, params)
        cot = {"output": rng.standard_normal(out.shape).astype(np.float32)}
        if weights is not None:  # a recurrent mixer has no attention weights
            cot["weights"] = rng.standard_normal(weights.shape).astype(np.float32)
        grads = backward(saved, cot["output"], cot.get("weights"))
    out, weights, grads, zero = reference.stored(case.config, out, weights, grads)
    expected = {"output": out} if weights is None else {"output": out, "weights": weights}
    if reference.selected_keys(saved) is not None:  # an indexer's choice: the keys, int32
        expected["key_indices"] = reference.selected_keys(saved)
    return Fixture(name=case.name, variant=case.variant, seed=case.seed, config=case.config,
                   dtypes=list(case.dtypes), inputs=inputs, params=params, cotangents=cot,
                   expected=expected, grads=grads, zero=zero)


def regenerate(check: bool = False, directory=FIXTURE_DIR, log=print) -> int:
    """Write (or with check=True only compare) every fixture, then the manifest; return the
    number of files (fixtures and ``MANIFEST.json``) that differ.

    Each file is replaced atomically and the manifest last, so a run killed at any moment
    leaves every file whole, old or new; the manifest then disagrees with the new files (the
    loader says so) until the next run, which rewrites what differs. Temporary files a killed
    run left behind are removed (the loader never reads them). Not meant to run twice at once
    on one directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    built = {c.name + ".npz": (c, to_bytes(build(c))) for c in CASES}
    manifest = manifest_bytes({name: manifest_entry(data, c.name, c.seed)
                               for name, (c, data) in built.items()})
    for leftover in sorted(p for p in directory.iterdir() if is_temporary(p.name)):
        if check:
            log(f"note: {leftover.name} is left from an interrupted run (the next regenerate "
                f"removes it)")
        else:
            leftover.unlink(missing_ok=True)
            log(f"removed {leftover.name} (left from an interrupted run)")
    differ = 0
    for name, (case, data) in built.items():
        path = directory / name
        if path.exists() and path.read_bytes() == data:
            continue
        differ += 1
        if check:
            log(f"differs: {path.name} ({'changed' if path.exists() else 'missing'})")
        else:
            write_atomic(path, data)
            log(f"wrote {path.name}")
    for stale in sorted(p for p in directory.glob("*.npz") if p.name not in built):
        differ += 1
        if check:
            log(f"differs: {stale.name} (no such case)")
        else:
            stale.unlink()
            log(f"removed {stale.name} (no such case)")
    path = directory / MANIFEST_NAME
    old = path.read_bytes() if path.exists() else None
    if old != manifest:
        differ += 1
        if check:
            log(f"differs: {MANIFEST_NAME} ({_manifest_change(old, manifest)})")
        else:
            write_atomic(path, manifest)
            log(f"wrote {MANIFEST_NAME}")
    log(f"{len(CASES)} cases, {differ} {'differ' if check else 'updated'}")
    return differ


def _manifest_change(old: bytes | None, new: bytes) -> str:
    """What differs between the manifest on disk and the one the cases give, in words."""
    if old is None:
        return "missing"
    try:
        old_doc = json.loads(old)
        new_doc = json.loads(new)
        files = sorted(n for n in {*old_doc["files"], *new_doc["files"]}
                       if old_doc["files"].get(n) != new_doc["files"].get(n))
    except (ValueError, TypeError, KeyError, AttributeError):
        return "unreadable"
    if files:
        return f"entries differ: {', '.join(files[:5])}{', …' if len(files) > 5 else ''}"
    if old_doc.get("numpy") != new_doc["numpy"]:
        return f"written by NumPy {old_doc.get('numpy')}, this is {new_doc['numpy']}"
    return "changed"
