"""Golden fixtures for attn-parity: the float64 NumPy reference, the fixture format and loader,
the declarative case list and the regeneration script.

The house, a room a role (docs/architecture.md): ``golden.specification`` and
``golden.reference`` (the specification and its float64 reference, NumPy only); ``golden.hf``
and ``golden.convert`` (the Hugging Face importer, the converters); ``golden.harness``,
``golden.runners`` and ``golden.report`` (check, regenerate, the runners, the reports);
``golden.port`` and ``golden.compare`` (tools for a user's own port); ``golden.verifier`` (the
checkpoint verifier); ``golden.bench`` (the benchmark); ``golden.cli`` (the command)."""

import importlib
import importlib.abc
import importlib.util
import sys

from golden.specification.fixture import (
    FIXTURE_DIR,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Fixture,
    FixtureError,
    load,
    read_manifest,
)

# The modules' names before the house had rooms, kept for code written against them: importing
# ``golden.variants`` gives the very module ``golden.specification.variants`` (one module
# object, so a patch through either name is seen by both). ``python -m`` takes the new names.
MOVED = {f"golden.{name}": f"golden.{room}.{name}" for room, names in {
    "specification": ["variants", "validate", "positions", "exact", "cases", "fixture",
                      "tolerances", "implementations", "decoder", "mapping"],
    "harness": ["check", "regenerate", "listing"],
    "runners": ["frameworks"],
    "port": ["training", "testing"]}.items() for name in names}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of ``MOVED`` and loads it as the module under its new name."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system sets the alias's spec on it
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # put its own spec back


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def names() -> list[str]:
    """Names of the shipped fixtures, sorted."""
    return sorted(p.stem for p in FIXTURE_DIR.glob("*.npz"))


__all__ = ["FIXTURE_DIR", "FORMAT_VERSION", "MANIFEST_NAME", "Fixture", "FixtureError", "load",
           "names", "read_manifest"]
