"""The golden fixture file: a deterministic, pickle-free ``.npz`` and its validating loader.

A fixture is a zip of ``.npy`` members (readable by ``numpy.load(..., allow_pickle=False)``):

    meta                 0-d unicode array holding JSON: format, format_version, name, variant,
                         seed, config, dtypes (those the frameworks run it at), the names
                         listed under inputs, params and grads, and under zero the gradients
                         that are zero in exact arithmetic (golden.reference.zero_grads)
    inputs/<name>        arrays fed to the variant (floats stored as float32, masks as bool,
                         integer offsets and lengths as int32; these have no gradient)
    params/<name>        module weights in the neutral layout (y = x W + b, W is (in, out))
    cotangents/output    dO, cotangents/weights dA: the fixed loss is Σ O⊙dO + Σ A⊙dA
    expected/output      float64 reference output, expected/weights the float64 weights
    grads/<name>         float64 dL/d<name> for every float input and every parameter
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from golden import variants

FORMAT = "attn-parity-fixture"
FORMAT_VERSION = 2  # 2: meta lists the gradients that are zero by structure
DTYPES = ("float32", "float64", "bfloat16", "float16")
FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed member timestamps make the bytes reproducible


class FixtureError(ValueError):
    """A fixture file that is corrupt, truncated, foreign or inconsistent."""


@dataclass
class Fixture:
    name: str
    variant: str
    seed: int
    config: dict
    inputs: dict
    dtypes: list = field(default_factory=lambda: ["float32", "float64"])
    params: dict = field(default_factory=dict)
    cotangents: dict = field(default_factory=dict)
    expected: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    zero: list = field(default_factory=list)  # gradients zero in exact arithmetic
    path: Path | None = None

    def meta(self) -> dict:
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION, "name": self.name,
            "variant": self.variant, "seed": self.seed, "config": self.config,
            "dtypes": self.dtypes,
            "inputs": sorted(self.inputs), "params": sorted(self.params),
            "grads": sorted(self.grads), "zero": sorted(self.zero),
        }

    def arrays(self) -> dict:
        """Every member of the file, meta first, in a fixed order."""
        out = {"meta": np.array(json.dumps(self.meta(), sort_keys=True))}
        for group in ("inputs", "params", "cotangents", "expected", "grads"):
            for k in sorted(getattr(self, group)):
                out[f"{group}/{k}"] = np.asarray(getattr(self, group)[k])
        return out


def to_bytes(fixture: Fixture) -> bytes:
    """The exact bytes of the fixture file: stored (uncompressed) members, fixed timestamps."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for key, arr in fixture.arrays().items():
            member = io.BytesIO()
            np.lib.format.write_array(member, arr, allow_pickle=False)
            zf.writestr(zipfile.ZipInfo(key + ".npy", date_time=_ZIP_DATE), member.getvalue())
    return buf.getvalue()


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file beside ``path`` and rename it over: never a half file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def resolve(name_or_path) -> Path:
    """A path as given if it exists, else the shipped fixture of that name."""
    p = Path(name_or_path)
    if p.exists():
        return p
    shipped = FIXTURE_DIR / (p.name if p.suffix == ".npz" else p.name + ".npz")
    if shipped.exists():
        return shipped
    raise FileNotFoundError(f"no fixture {str(name_or_path)!r} (looked in {FIXTURE_DIR})")


def load(name_or_path) -> Fixture:
    """Load and validate a fixture by shipped name or by path. Never unpickles."""
    path = resolve(name_or_path)
    try:
        with np.load(path, allow_pickle=False) as z:
            members = {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, KeyError) as e:
        raise FixtureError(f"{path}: not a readable fixture ({type(e).__name__}: {e})") from None
    return _from_members(path, members)


def _from_members(path, members) -> Fixture:
    def fail(problem):
        raise FixtureError(f"{path}: {problem}")

    if "meta" not in members:
        fail("no 'meta' member; this is not an attn-parity fixture")
    try:
        meta = json.loads(str(members["meta"][()]))
    except (json.JSONDecodeError, TypeError, IndexError) as e:
        fail(f"'meta' is not valid JSON ({e})")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fail(f"'meta.format' should be {FORMAT!r}; this is not an attn-parity fixture")
    if meta.get("format_version") != FORMAT_VERSION:
        fail(f"format_version should be {FORMAT_VERSION}, got {meta.get('format_version')!r}")
    unknown = set(meta.get("dtypes", ())) - set(DTYPES)
    if not meta.get("dtypes") or unknown:
        fail(f"meta.dtypes should be a non-empty list drawn from {DTYPES}, "
             f"got {meta.get('dtypes')!r}")
    required = {"meta", "cotangents/output", "cotangents/weights", "expected/output",
                 "expected/weights"}
    for group in ("inputs", "params", "grads"):
        required |= {f"{group}/{n}" for n in meta.get(group, [])}
    missing, extra = sorted(required - set(members)), sorted(set(members) - required)
    if missing or extra:
        fail(f"members do not match meta: missing {missing}, unexpected {extra}")
    groups = {g: {k.split("/", 1)[1]: v for k, v in members.items() if k.startswith(g + "/")}
              for g in ("inputs", "params", "cotangents", "expected", "grads")}
    zero = meta.get("zero")
    if not isinstance(zero, list) or not set(zero) <= set(groups["grads"]):
        fail(f"meta.zero should list gradients among {sorted(groups['grads'])}, got {zero!r}")
    _check_consistency(fail, meta, groups)
    return Fixture(name=meta["name"], variant=meta["variant"], seed=meta["seed"],
                   config=meta["config"], dtypes=meta["dtypes"], zero=zero, path=Path(path),
                   **groups)


def _check_consistency(fail, meta, groups) -> None:
    sources = {**groups["inputs"], **groups["params"]}
    for n, g in groups["grads"].items():
        if n not in sources or g.shape != sources[n].shape:
            fail(f"grads/{n} shape {g.shape} does not match the array it differentiates")
    for n in ("output", "weights"):
        if groups["cotangents"][n].shape != groups["expected"][n].shape:
            fail(f"cotangents/{n} shape {groups['cotangents'][n].shape} differs from "
                 f"expected/{n} shape {groups['expected'][n].shape}")
    for group in ("expected", "grads"):
        for n, a in groups[group].items():
            if a.dtype != np.float64 or not np.all(np.isfinite(a)):
                fail(f"{group}/{n} should be finite float64, got {a.dtype}")
    try:
        variant = variants.get(meta["variant"])
        config = variant.config(meta["config"])
        variant.check_params(config, groups["params"])
    except (ValueError, KeyError, TypeError) as e:
        fail(f"variant, config and params disagree: {e}")
    inputs = groups["inputs"]
    rate = config.get("dropout", 0.0) if "dropout_mask" in inputs else 0.0
    try:
        shape = variant.check_inputs(config, inputs, rate)
    except (ValueError, KeyError) as e:
        fail(f"inputs inconsistent with config: {e}")
    if groups["expected"]["weights"].shape != tuple(shape):
        fail(f"expected/weights shape {groups['expected']['weights'].shape} should be {shape}")
