"""Golden fixtures for attn-parity: the float64 NumPy reference, the fixture format and loader,
the declarative case list and the regeneration script."""

from golden.fixture import (
    FIXTURE_DIR,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Fixture,
    FixtureError,
    load,
    read_manifest,
)


def names() -> list[str]:
    """Names of the shipped fixtures, sorted."""
    return sorted(p.stem for p in FIXTURE_DIR.glob("*.npz"))


__all__ = ["FIXTURE_DIR", "FORMAT_VERSION", "MANIFEST_NAME", "Fixture", "FixtureError", "load",
           "names", "read_manifest"]
