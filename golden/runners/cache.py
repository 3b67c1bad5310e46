"""JAX's persistent compilation cache for the ``attn-parity`` commands: a second run loads each
compiled program from disk instead of compiling it again.

    enable()            the cache in ``default_directory()``; returns the directory (None:
                        JAX not installed, or no directory could be made)
    enable("/some/dir") the cache there
    disable()           back to the settings before ``enable``
    default_directory() $ATTN_PARITY_CACHE_DIR, else $XDG_CACHE_HOME/attn-parity/jax,
                        else ~/.cache/attn-parity/jax

    programs_directory()  where golden.runners.stored keeps traced programs while enabled
                        (the ``programs`` folder inside; None while disabled, or without
                        the flatbuffers package that jax.export serializes with)

``attn-parity check`` and ``hf`` enable it unless ``--no-cache`` is given. JAX keys a compiled
entry by the lowered program, the jaxlib version, the backend, the XLA flags and the compile
options, so other flags never load a stale program. ``check``'s JAX runner also keeps each
fixture's traced program (golden.runners.stored, keyed by the source of ``jax_attn`` and
``golden``, the versions and the row), so a second run neither traces nor lowers it again. An
entry that cannot be read (a corrupt file) is a warning and a fresh compilation or trace, not a
failure (JAX's default, ``jax_raise_persistent_cache_errors`` off). JAX trusts the directory:
keep it private (JAX's documentation, "Persistent compilation cache").
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

ENV = "ATTN_PARITY_CACHE_DIR"

# Every program is written, however small or quick to compile: the check's are 8 to 75 KB
# and compile in 0.1 to 2 s each, under JAX's default threshold of 1 s for most.
_SETTINGS = {"jax_persistent_cache_min_compile_time_secs": 0.0,
             "jax_persistent_cache_min_entry_size_bytes": -1}
_saved: dict | None = None  # the settings enable() replaced, for disable()
_programs: Path | None = None  # where golden.runners.stored keeps traced programs, once enabled


def programs_directory() -> Path | None:
    """Where the JAX runner keeps its traced programs (golden.runners.stored): the
    ``programs`` folder of the enabled cache; None while the cache is off."""
    return _programs


def default_directory() -> Path:
    """Where ``enable()`` puts the cache by default."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attn-parity" / "jax"


def enable(directory: str | os.PathLike | None = None) -> Path | None:
    """Compile through JAX's persistent cache in ``directory`` (default:
    ``default_directory()``) from the next compilation on; the directory is made if missing.
    Returns it, or None (nothing changed) when JAX is not installed or the directory cannot
    be made (a warning)."""
    try:
        import jax
        from jax.experimental.compilation_cache import compilation_cache
    except ImportError:
        return None
    path = Path(directory).expanduser() if directory else default_directory()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warnings.warn(f"attn-parity: no compilation cache ({e})", stacklevel=2)
        return None
    settings = {"jax_compilation_cache_dir": str(path), **_SETTINGS}
    global _saved
    if _saved is None:
        _saved = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # JAX opens its cache once: reopen it in the new place
    global _programs
    try:
        if importlib.util.find_spec("flatbuffers") is None:  # jax.export cannot serialize
            raise OSError("the flatbuffers package is not installed")
        (path / "programs").mkdir(exist_ok=True)
        _programs = path / "programs"
    except OSError as e:
        warnings.warn(f"attn-parity: no stored programs ({e})", stacklevel=2)
    return path


def disable() -> None:
    """Undo ``enable()``: JAX's cache settings as they were before it (no cache, unless the
    caller had one)."""
    global _saved
    if _saved is None:
        return
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    for name, value in _saved.items():
        jax.config.update(name, value)
    _saved = None
    global _programs
    _programs = None
    compilation_cache.reset_cache()
