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
                         (a recurrent mixer, golden.specification.recurrent, has no attention
                         weights: neither weights member, the loss Σ O⊙dO)
    expected/key_indices with a learned indexer (latent attention's index_topk, or
                         grouped-query attention's block indexer index_blocks) alone: the
                         keys it chose, int32 (..., [H,] Lq, k) (golden.reference.indexer); no
                         cotangent, no gradient (a choice, not a value)
    grads/<name>         float64 dL/d<name> for every float input and every parameter

Beside the shipped fixtures, ``MANIFEST.json`` (written last by ``golden.harness.regenerate``)
records each file's sha256 and size, the case and seed it was built from, the fixture format version
and the NumPy that wrote it; ``load`` checks a shipped fixture against it before parsing anything.

The loader trusts no size in the file: the zip's members, their local headers and the ``.npy``
headers are checked against the bytes actually present (and against ``MAX_*`` bounds) before
any array is allocated, and every malformed file is a ``FixtureError`` naming the file.
"""

from __future__ import annotations

import difflib
import hashlib
import io
import json
import math
import os
import re
import struct
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from golden.specification import variants
from golden.specification.indexer import block_key_shape
from golden.specification.validate import DTYPES

FORMAT = "attn-parity-fixture"
# 2: meta lists the zero-by-structure gradients; 3: exact values (golden.specification.exact)
FORMAT_VERSION = 3
FIXTURE_DIR = Path(__file__).resolve().parents[1] / "fixtures"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed member timestamps make the bytes reproducible

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "attn-parity-manifest"
MANIFEST_VERSION = 1

# Bounds checked before anything is allocated (the shipped fixtures: < 32 KB, at most 25 members).
MAX_FILE_BYTES = 256 * 2**20
MAX_MANIFEST_BYTES = 16 * 2**20
MAX_MEMBERS = 256
MAX_NDIM = 16
MAX_RATIO = 2  # a compressed member expanding more than this is called a zip bomb in the message
_TEMPORARY = re.compile(r"^\.(?:.+\.npz|" + re.escape(MANIFEST_NAME) + r")\.[A-Za-z0-9_]+\.tmp$")


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
    # {parameter: the size of the terms its gradient's elements sum}, for a fixture made in
    # memory from random inputs (attn-parity hf: golden.reference.parameter_term_sizes); its
    # gradients are held to compare_terms. Never stored: a file's gradients keep the table.
    term_sizes: dict = field(default_factory=dict)

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
    """Write to a temporary file beside ``path`` and rename it over: never a half file. The
    file gets the mode a new file gets, 0o666 & ~umask (``tempfile.mkstemp`` makes it 0o600,
    which a web server, a CI artifact upload or a colleague could not read)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _sync_directory(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def umask() -> int:
    """The process's umask (read by setting it and putting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _sync_directory(directory: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary file ``write_atomic`` leaves behind when killed mid-write
    (``.<fixture>.npz.<random>.tmp`` or the manifest's); never loaded, removed by regenerate."""
    return bool(_TEMPORARY.match(name))


# ---- the manifest ------------------------------------------------------------------------------

def manifest_entry(data: bytes, case: str, seed: int) -> dict:
    """The manifest's record of one fixture file's bytes."""
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "seed": seed,
            "case": case}


def manifest_bytes(files: dict) -> bytes:
    """The exact bytes of ``MANIFEST.json`` for {file name: manifest_entry(...)}: sorted keys,
    one field a line, so that unchanged fixtures give an unchanged manifest."""
    doc = {"format": MANIFEST_FORMAT, "format_version": MANIFEST_VERSION,
           "fixture_format_version": FORMAT_VERSION, "numpy": np.__version__, "files": files}
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


def read_manifest(path) -> dict:
    """A manifest, validated; ``FixtureError`` naming the manifest and the problem."""
    path = Path(path)

    def fail(problem):
        raise FixtureError(f"{path}: {problem}")

    data = _read_bytes(path, MAX_MANIFEST_BYTES, "manifest")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        fail(f"not a readable manifest ({type(e).__name__}: {_short(e)})")
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        fail(f"'format' should be {MANIFEST_FORMAT!r}; this is not an attn-parity manifest")
    if doc.get("format_version") != MANIFEST_VERSION:
        fail(f"format_version should be {MANIFEST_VERSION}, got "
             f"{_short(doc.get('format_version'))}")
    if not isinstance(doc.get("files"), dict):
        fail(f"'files' should be an object, got {_short(doc.get('files'))}")
    for name, entry in doc["files"].items():
        ok = (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
              and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]) is not None
              and _is_int(entry.get("bytes")) and entry["bytes"] >= 0
              and _is_int(entry.get("seed")) and isinstance(entry.get("case"), str))
        if not ok:
            fail(f"files[{name!r}] should hold sha256 (64 hex digits), bytes, seed and case, "
                 f"got {_short(entry)}")
    return doc


def _verify(path: Path, data: bytes, manifest: Path, shipped: bool) -> dict:
    """The manifest's entry for ``path``, whose bytes are ``data``; FixtureError on a mismatch."""
    fix = ": run `attn-parity regenerate` to rebuild it, or restore it from git" if shipped else ""
    try:
        doc = read_manifest(manifest)
    except FixtureError as e:
        raise FixtureError(f"{path}: cannot be verified: {e}" + (
            " (run `attn-parity regenerate` to rewrite the manifest, or restore it from git)"
            if shipped else "")) from None
    if doc.get("fixture_format_version") != FORMAT_VERSION:
        raise FixtureError(f"{path}: {manifest} was written for fixture format "
                           f"{_short(doc.get('fixture_format_version'))}, this loader reads "
                           f"{FORMAT_VERSION}{fix}")
    entry = doc["files"].get(path.name)
    if entry is None:
        raise FixtureError(f"{path}: not listed in {manifest}" + (
            "; a file `attn-parity regenerate` did not write: run it (it removes files of no "
            "case and rewrites the manifest), or restore the fixtures from git" if shipped
            else ""))
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"] or len(data) != entry["bytes"]:
        raise FixtureError(f"{path}: sha256 {digest[:16]}… ({len(data)} bytes) does not match "
                           f"{manifest} ({entry['sha256'][:16]}…, {entry['bytes']} bytes); the "
                           f"file was altered, or a regeneration was interrupted{fix}")
    return entry


# ---- reading -----------------------------------------------------------------------------------

class FixtureNotFound(FileNotFoundError, ValueError):
    """No file at that path and no shipped fixture of that name: a missing file to those who
    catch OSError, a bad argument to those who catch ValueError."""


def resolve(name_or_path) -> Path:
    """A path as given if it exists, else the shipped fixture of that name."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path should be a fixture name (str) or a path, got "
                        f"{type(name_or_path).__name__} {name_or_path!r}")
    p = Path(name_or_path)
    if p.exists():
        return p
    shipped = FIXTURE_DIR / (p.name if p.suffix == ".npz" else p.name + ".npz")
    if shipped.exists():
        return shipped
    known = sorted(q.stem for q in FIXTURE_DIR.glob("*.npz"))
    near = difflib.get_close_matches(p.stem, known, n=3)
    raise FixtureNotFound(
        f"name_or_path should name a shipped fixture ({len(known)} in {FIXTURE_DIR}: "
        f"golden.names()) or an existing file, got {str(name_or_path)!r}: no such file or "
        f"fixture" + (f"; did you mean {', '.join(near)}?" if near else ""))


def _is_shipped(path: Path) -> bool:
    try:
        return path.resolve().parent == FIXTURE_DIR.resolve()
    except (OSError, RuntimeError):
        return False


def load(name_or_path, manifest=None) -> Fixture:
    """Load and validate a fixture by shipped name or by path. Never unpickles.

    A shipped fixture (one in ``FIXTURE_DIR``) is first checked against ``MANIFEST.json`` beside
    it; any other file against ``manifest`` (a path) when given, else only validated. Every
    problem is a ``FixtureError`` naming the file (a missing name or file: ``FixtureNotFound``,
    both a FileNotFoundError and a ValueError)."""
    path = resolve(name_or_path)
    data = _read_bytes(path, MAX_FILE_BYTES, "fixture")
    entry = None
    if manifest is not None:
        entry = _verify(path, data, Path(manifest), shipped=False)
    elif _is_shipped(path):
        entry = _verify(path, data, FIXTURE_DIR / MANIFEST_NAME, shipped=True)
    try:
        fixture = _from_members(path, read_members(path, data))
    except FixtureError:
        raise
    except Exception as e:  # the last guard: whatever slipped past the checks is still named
        raise FixtureError(f"{path}: not a valid fixture ({type(e).__name__}: {_short(e)})"
                           ) from None
    if entry is not None and (entry["case"], entry["seed"]) != (fixture.name, fixture.seed):
        raise FixtureError(f"{path}: holds case {fixture.name!r} seed {fixture.seed}, the "
                           f"manifest says case {entry['case']!r} seed {entry['seed']}")
    return fixture


def _read_bytes(path: Path, limit: int, what: str) -> bytes:
    """The whole file, if it is at most ``limit`` bytes."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise FixtureError(f"{path}: {size} bytes, more than a {what} may have ({limit})")
            data = f.read(limit + 1)
    except OSError as e:
        raise FixtureError(f"{path}: not a readable {what} ({type(e).__name__}: {e})") from None
    if len(data) > limit:
        raise FixtureError(f"{path}: more than the {limit} bytes a {what} may have")
    return data


_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile's structFileHeader: 30 bytes
_FLAGS_ALLOWED = 0x0008 | 0x0800  # sizes in a data descriptor; UTF-8 names


def read_members(path, data: bytes | None = None) -> dict:
    """{member name without ``.npy``: array} of a fixture file (``data``: its bytes, if read).

    Nothing is allocated from a size the file claims: the member count, every member's span,
    local header, CRC-32 and ``.npy`` header are checked against the bytes present first.
    Members must be stored uncompressed and hold plain numbers, bools or strings (never
    objects). Any problem: ``FixtureError("<path>: not a readable fixture (...)")``."""
    path = Path(path)
    if data is None:
        data = _read_bytes(path, MAX_FILE_BYTES, "fixture")

    def bad(problem):
        raise FixtureError(f"{path}: not a readable fixture ({problem})")

    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except Exception as e:  # BadZipFile, EOFError, ValueError, struct.error, UnicodeDecodeError
        bad(f"{type(e).__name__}: {_short(e)}")
    with zf:
        infos = zf.infolist()
        end_of_data = min(getattr(zf, "start_dir", len(data)), len(data))
    if len(infos) > MAX_MEMBERS:
        bad(f"{len(infos)} members, more than the {MAX_MEMBERS} a fixture may have")
    spans, names = [], set()
    for info in infos:
        name = info.orig_filename
        if not name.endswith(".npy"):
            bad(f"member {name!r} is not a .npy array")
        if name in names:
            bad(f"member {name!r} appears twice")
        names.add(name)
        if info.flag_bits & ~_FLAGS_ALLOWED:
            bad(f"member {name!r} uses zip features a fixture never has (flags "
                f"{info.flag_bits:#06x}: encryption or patch data)")
        if info.compress_type != zipfile.ZIP_STORED:
            ratio = info.file_size / max(info.compress_size, 1)
            bad(f"member {name!r} is compressed (method {info.compress_type}: {info.compress_size}"
                f" bytes claiming to expand to {info.file_size}, {ratio:.0f}:1"
                + (", a zip bomb" if ratio > MAX_RATIO else "")
                + "); fixture members are stored uncompressed")
        if info.file_size != info.compress_size:
            bad(f"stored member {name!r} claims {info.file_size} bytes uncompressed but "
                f"{info.compress_size} stored")
        spans.append((*_member_span(data, info, bad), name, info))
    spans.sort(key=lambda s: s[0])
    for (_, _, end, name, _), (head, *_, other, _) in zip(spans, spans[1:]):
        if head < end:
            bad(f"members {name!r} and {other!r} overlap")
    if spans and spans[-1][2] > end_of_data:
        bad(f"member {spans[-1][3]!r} runs into the central directory")
    members = {}
    view = memoryview(data)
    for _, start, end, name, info in spans:
        raw = view[start:end]
        if zlib.crc32(raw) != info.CRC:
            bad(f"member {name!r} fails its CRC-32 check: its bytes were altered")
        members[name[:-4]] = _parse_npy(raw, name, bad)
    return members


def _member_span(data: bytes, info: zipfile.ZipInfo, bad) -> tuple[int, int, int]:
    """(start of the local header, start and end of the data) of a member, checked against the
    file and the central directory."""
    name, off = info.orig_filename, info.header_offset
    if not 0 <= off <= len(data) - _LOCAL_HEADER.size:
        bad(f"member {name!r}: its local header at {off} lies outside the file")
    (magic, version, system, flags, method, dostime, dosdate, crc, stored, size, name_len,
     extra_len) = _LOCAL_HEADER.unpack_from(data, off)
    if magic != b"PK\x03\x04":
        bad(f"member {name!r}: no local header at offset {off}")
    raw_name = data[off + _LOCAL_HEADER.size:off + _LOCAL_HEADER.size + name_len]
    local_name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", errors="replace")
    if local_name != name:
        bad(f"member {name!r}: its local header names {local_name!r}")
    y, mo, d, h, mi, sec = info.date_time
    central = (info.extract_version, info.reserved, info.flag_bits, info.compress_type,
               (h << 11) | (mi << 5) | (sec // 2), ((y - 1980) << 9) | (mo << 5) | d, 0)
    sizes = (stored, size) in ((info.compress_size, info.file_size), (0xFFFFFFFF, 0xFFFFFFFF))
    if ((version, system, flags, method, dostime, dosdate, info.volume) != central
            or not (flags & 0x08 or crc == info.CRC and sizes)):
        bad(f"member {name!r}: its local header disagrees with the central directory")
    start = off + _LOCAL_HEADER.size + name_len + extra_len
    end = start + info.compress_size
    if end > len(data):
        bad(f"member {name!r} runs past the end of the file ({end} > {len(data)} bytes): "
            f"truncated?")
    return off, start, end


def _parse_npy(raw: memoryview, name: str, bad) -> np.ndarray:
    """One ``.npy`` member's array; its header is checked against the bytes present first."""
    fp = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
        else:
            raise ValueError(f".npy version {version[0]}.{version[1]} is not one fixtures use")
    except Exception as e:  # ValueError, TypeError, SyntaxError, EOFError, MemoryError...
        bad(f"member {name!r}: bad .npy header ({type(e).__name__}: {_short(e)})")
    if dtype.hasobject:
        bad(f"member {name!r} holds Python objects (dtype {dtype}), which only pickle could "
            f"read; fixtures are never unpickled")
    if (dtype.names is not None or dtype.subdtype is not None or dtype.kind not in "biufU"
            or dtype.itemsize == 0):
        bad(f"member {name!r}: dtype {dtype} is not a plain number, bool or string")
    if (not isinstance(shape, tuple) or len(shape) > MAX_NDIM
            or not all(type(n) is int and n >= 0 for n in shape)):
        bad(f"member {name!r}: shape {_short(shape)} is not at most {MAX_NDIM} sizes >= 0")
    count, offset = math.prod(shape), fp.tell()
    if count * dtype.itemsize != len(raw) - offset:  # Python ints: no overflow
        bad(f"member {name!r}: its header claims shape {shape} of {dtype} "
            f"({count * dtype.itemsize} bytes) but it holds {len(raw) - offset} bytes of data")
    flat = np.frombuffer(raw, dtype=dtype, count=count, offset=offset)
    return flat.astype(dtype.newbyteorder("="), copy=True).reshape(shape,
                                                                  order="F" if fortran else "C")


# ---- validation --------------------------------------------------------------------------------

def _from_members(path, members) -> Fixture:
    def fail(problem):
        raise FixtureError(f"{path}: {problem}")

    if "meta" not in members:
        fail("no 'meta' member; this is not an attn-parity fixture")
    if members["meta"].dtype.kind != "U" or members["meta"].shape != ():
        fail(f"'meta' should be a 0-d unicode array holding JSON, got {members['meta'].dtype} "
             f"of shape {members['meta'].shape}")
    try:
        meta = json.loads(str(members["meta"][()]))
    except (ValueError, TypeError, IndexError, RecursionError) as e:
        fail(f"'meta' is not valid JSON ({_short(e)})")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fail(f"'meta.format' should be {FORMAT!r}; this is not an attn-parity fixture")
    if meta.get("format_version") != FORMAT_VERSION:
        fail(f"format_version should be {FORMAT_VERSION}, got {_short(meta.get('format_version'))}")
    dtypes = meta.get("dtypes")
    if (not isinstance(dtypes, list) or not dtypes
            or not all(isinstance(d, str) and d in DTYPES for d in dtypes)):
        fail(f"meta.dtypes should be a non-empty list drawn from {DTYPES}, got {_short(dtypes)}")
    _check_meta_fields(fail, meta)
    required = {"meta", "cotangents/output", "expected/output"}
    weights = {"cotangents/weights", "expected/weights"}  # none for a recurrent mixer
    if weights & set(members):
        required |= weights
    if isinstance(meta.get("config"), dict) and (meta["config"].get("index_topk") is not None
                                                 or meta["config"].get("index_blocks")):
        required.add("expected/key_indices")  # the indexer's choice
    for group in ("inputs", "params", "grads"):
        required |= {f"{group}/{n}" for n in meta[group]}
    missing, extra = sorted(required - set(members)), sorted(set(members) - required)
    if missing or extra:
        fail(f"members do not match meta: missing {missing}, unexpected {_short(extra)}")
    groups = {g: {k.split("/", 1)[1]: v for k, v in members.items() if k.startswith(g + "/")}
              for g in ("inputs", "params", "cotangents", "expected", "grads")}
    zero = meta.get("zero")
    if (not isinstance(zero, list) or not all(isinstance(z, str) for z in zero)
            or not set(zero) <= set(groups["grads"])):
        fail(f"meta.zero should list gradients among {sorted(groups['grads'])}, got "
             f"{_short(zero)}")
    _check_dtypes(fail, groups)
    _check_consistency(fail, meta, groups)
    return Fixture(name=meta["name"], variant=meta["variant"], seed=meta["seed"],
                   config=meta["config"], dtypes=meta["dtypes"], zero=zero, path=Path(path),
                   **groups)


def _check_meta_fields(fail, meta) -> None:
    for key, kind in (("name", str), ("variant", str), ("config", dict)):
        if not isinstance(meta.get(key), kind):
            fail(f"meta.{key} should be a {kind.__name__}, got {_short(meta.get(key))}")
    if not _is_int(meta.get("seed")):
        fail(f"meta.seed should be an integer, got {_short(meta.get('seed'))}")
    for group in ("inputs", "params", "grads"):
        names = meta.get(group)
        if (not isinstance(names, list) or not all(isinstance(n, str) for n in names)
                or len(set(names)) != len(names)):
            fail(f"meta.{group} should be a list of distinct names, got {_short(names)}")


def _check_dtypes(fail, groups) -> None:
    """Inputs: float32 where they have a gradient (float inputs), else bool, int32 (or float32,
    which the variant's own check names); params and cotangents float32; all finite. The
    float64 expectations and gradients are checked with the shapes (_check_consistency)."""
    f32 = np.dtype(np.float32)
    for n, a in groups["inputs"].items():
        if n in groups["grads"] and a.dtype != f32:
            fail(f"inputs/{n} should be float32 (a float input: it has a gradient), got "
                 f"{a.dtype}")
        if a.dtype not in (f32, np.dtype(np.bool_), np.dtype(np.int32)):
            fail(f"inputs/{n} should be float32, bool or int32, got {a.dtype}")
    for group in ("params", "cotangents"):
        for n, a in groups[group].items():
            if a.dtype != f32:
                fail(f"{group}/{n} should be float32, got {a.dtype}")
    for group in ("inputs", "params", "cotangents"):
        for n, a in groups[group].items():
            if a.dtype == f32 and not np.all(np.isfinite(a)):
                fail(f"{group}/{n} holds non-finite values")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v, limit: int = 120) -> str:
    """repr of ``v`` (str of an exception), cut to ``limit`` characters for messages."""
    text = str(v) if isinstance(v, BaseException) else repr(v)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _check_consistency(fail, meta, groups) -> None:
    sources = {**groups["inputs"], **groups["params"]}
    for n, g in groups["grads"].items():
        if n not in sources or g.shape != sources[n].shape:
            fail(f"grads/{n} shape {g.shape} does not match the array it differentiates")
    chosen = groups["expected"].pop("key_indices", None)  # checked apart: ints, no cotangent
    for n in groups["expected"]:
        if groups["cotangents"][n].shape != groups["expected"][n].shape:
            fail(f"cotangents/{n} shape {groups['cotangents'][n].shape} differs from "
                 f"expected/{n} shape {groups['expected'][n].shape}")
    for group in ("expected", "grads"):
        for n, a in groups[group].items():
            if a.dtype != np.float64 or not np.all(np.isfinite(a)):
                fail(f"{group}/{n} should be finite float64, got {a.dtype}")
    try:
        variant = variants.lookup(meta["variant"])
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
    if shape is None:  # a recurrent mixer: no attention weights
        if "weights" in groups["expected"]:
            fail(f"expected/weights should be absent: {meta['variant']} returns no attention "
                 f"weights")
    elif "weights" not in groups["expected"]:
        fail(f"members do not match meta: missing ['cotangents/weights', 'expected/weights'] "
             f"of shape {tuple(shape)}")
    elif groups["expected"]["weights"].shape != tuple(shape):
        fail(f"expected/weights shape {groups['expected']['weights'].shape} should be {shape}")
    if chosen is not None:
        _check_key_indices(fail, chosen, config, shape)
        groups["expected"]["key_indices"] = chosen


def _check_key_indices(fail, chosen, config, shape) -> None:
    """expected/key_indices: int32 (..., Lq, k), k = min(index_topk, Lk), in [0, Lk), each
    row's keys distinct; a block indexer's (index_blocks, golden.specification.indexer):
    (..., [H,] Lq, k) of block_key_width, in [0, Lk), repeats allowed (its fill rule)."""
    if config.get("index_blocks"):
        want = block_key_shape(config, shape)
        if chosen.dtype != np.int32 or chosen.shape != want:
            fail(f"expected/key_indices should be int32 of shape {want}, got {chosen.dtype} "
                 f"of shape {chosen.shape}")
        if chosen.size and (chosen.min() < 0 or chosen.max() >= shape[-1]):
            fail(f"expected/key_indices should be keys in [0, {shape[-1]})")
        return
    want = tuple(shape[:-3]) + (shape[-2], min(config["index_topk"], shape[-1]))
    if chosen.dtype != np.int32 or chosen.shape != want:
        fail(f"expected/key_indices should be int32 of shape {want}, got {chosen.dtype} of "
             f"shape {chosen.shape}")
    ordered = np.sort(chosen, axis=-1)
    if chosen.size and (ordered.min() < 0 or ordered.max() >= shape[-1]
                        or (np.diff(ordered, axis=-1) == 0).any()):
        fail(f"expected/key_indices should be distinct keys in [0, {shape[-1]}) per row")
