"""How every report file is written: whole or not at all
(``golden.specification.fixture.write_atomic``), its
parent directories created."""

from __future__ import annotations

from pathlib import Path

from golden.specification.fixture import write_atomic


def _write(path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically, creating its parent directories; the file gets
    the permissions the umask gives a new file (``write_atomic``), so that a web server or CI
    artifact upload can read it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    return path
