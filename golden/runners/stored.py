"""Traced programs kept on disk (``jax.export``), so that a second ``attn-parity check`` neither
traces nor compiles: it reads each fixture's program, and JAX's persistent compilation cache
(golden.runners.cache) its compiled form.

    load_or_export(directory, description, args, export) -> (jax.export.Exported, core)

A program is stored under the SHA-256 of everything its traced form depends on: the source of
``jax_attn`` and ``golden`` (any edit of either makes every program new), the versions of JAX,
jaxlib, Flax and NumPy, the backend and its device kind, the JAX settings that change a trace
(float64, default matmul precision, dtype and rank promotion), and the row itself (variant,
config, dtype, mode, and the names, shapes and dtypes of the arguments). Array values are
arguments of the program, never part of it. A stored file is JAX's own serialization (a
flatbuffer holding StableHLO, read without pickle) after a header line repeating what the
name is a hash of; a file whose header differs, or that cannot be read, is a warning and a new
trace, never a wrong program. Files are written whole (a temporary name, then renamed).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

MAGIC = b"attn-parity traced program 1\n"
SUFFIX = ".jaxprogram"


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """SHA-256 of every ``.py`` file of the installed ``jax_attn`` and ``golden`` packages."""
    import golden
    import jax_attn

    digest = hashlib.sha256()
    for package in (jax_attn, golden):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _environment() -> dict:
    import flax
    import jax
    import jaxlib
    import numpy as np

    config = jax.config
    return {"source": source_digest(),
            "versions": [jax.__version__, jaxlib.__version__, flax.__version__,
                         np.__version__],
            "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
            "settings": [bool(config.jax_enable_x64),
                         str(config.jax_default_matmul_precision),
                         str(config.jax_numpy_dtype_promotion),
                         str(config.jax_numpy_rank_promotion)]}


def _signature(args) -> list:
    """[path, shape, dtype] of every leaf of ``args``, in JAX's flattening order."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    return [[jax.tree_util.keystr(p), list(a.shape), str(a.dtype)] for p, a in leaves]


def header(description: dict, args) -> dict:
    """What a program's file name is the hash of (and its header line repeats)."""
    return {"environment": _environment(), "row": description, "arguments": _signature(args)}


def load_or_export(directory, description: dict, args, export):
    """(the Exported program, the core implementations its trace ran): read from
    ``directory`` when stored there for ``description`` (JSON-able: what the trace depends on
    besides the arguments' shapes and dtypes) and ``args``; else ``export()`` (which returns
    that pair) and store it."""
    from jax import export as jax_export

    head = header(description, args)
    text = json.dumps(head, sort_keys=True, default=repr)
    path = Path(directory) / (hashlib.sha256(text.encode()).hexdigest() + SUFFIX)
    if (path, text) in _LOADED:  # this process read or traced it already
        return _LOADED[path, text]
    found = None
    if path.exists():
        try:
            found = _read(path, text, jax_export)
        except Exception as e:  # noqa: BLE001 - any unreadable file is traced again
            warnings.warn(f"attn-parity: stored program {path.name} not used ({e}); "
                          "tracing it again", stacklevel=2)
    if found is None:
        found = export()
        _write(path, text, found[1], found[0].serialize())
    _LOADED[path, text] = found
    return found


# The programs this process has read or traced, by file and header: the same Exported object
# called again (hf's layers of one shape) is served by JAX's in-memory caches, not lowered anew.
_LOADED: dict = {}


def _read(path: Path, text: str, jax_export):
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError("not a stored program")
    line_end = data.index(b"\n", len(MAGIC))
    meta = json.loads(data[len(MAGIC):line_end])
    if json.dumps(meta["header"], sort_keys=True, default=repr) != text:
        raise ValueError("its header differs from the program asked for")
    return jax_export.deserialize(bytearray(data[line_end + 1:])), meta["core"]


def _write(path: Path, text: str, core: str, program: bytes) -> None:
    line = json.dumps({"header": json.loads(text), "core": core}, sort_keys=True)
    temporary = None
    try:
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".partial")
        with os.fdopen(handle, "wb") as f:
            f.write(MAGIC + line.encode() + b"\n" + bytes(program))
        os.replace(temporary, path)
    except OSError as e:  # a read-only or full cache: this run works, the next traces again
        warnings.warn(f"attn-parity: could not store program {path.name} ({e})", stacklevel=3)
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
