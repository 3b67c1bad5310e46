"""The public names keep working as the house moves: every ``golden.…`` name the README and
docs/ cite, and the entry points the issues and users name, import and resolve."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import golden

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = sorted({m for page in PAGES for m in re.findall(
    r"\b(?:golden|torch_attn|jax_attn)(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?", page.read_text())})
# Named for users outside the docs' prose: the command line, the converters, the pytest helpers,
# the recipes `check --impl` takes, each twin's modules.
ENTRY_POINTS = ["golden.cli:main", "golden.convert.from_hf", "golden.convert.to_hf",
                "golden.hf.from_hf", "golden.testing.assert_port", "golden.testing.assert_impl",
                "golden.port.testing.assert_port", "golden.port.testing.assert_impl",
                "golden.runners.recipes:JAX_NN", "golden.runners.recipes:FLAX_NNX",
                "golden.runners.recipes:TORCH_SDPA", "golden.compare.compare",
                "golden.compare.check_port", "golden.compare.freeze", "golden.compare.load_port",
                "golden.check.run", "golden.harness.check.run", "golden.reference.VARIANTS",
                "golden.report.write_json",
                "golden.report.write_junit", "golden.report.write_html", "golden.bench.main",
                "torch_attn.modules.GroupedQueryAttention", "jax_attn.modules.GroupedQueryAttention",
                "torch_attn.build", "jax_attn.build", "golden.load", "golden.names",
                "jax_attn.GatedDeltaNet", "jax_attn.recurrent.gated_delta_rule",
                "torch_attn.GatedDeltaNet", "torch_attn.recurrent.gated_delta_rule",
                "torch_attn.recurrent.DELTA_RULE_IMPLEMENTATIONS",
                "jax_attn.recurrent.DELTA_RULE_IMPLEMENTATIONS",
                "jax_attn.KimiDeltaAttention", "jax_attn.LightningAttention",
                "jax_attn.recurrent.lightning_rule",
                "jax_attn.recurrent.LIGHTNING_IMPLEMENTATIONS",
                "torch_attn.KimiDeltaAttention", "torch_attn.LightningAttention",
                "torch_attn.recurrent.lightning_rule",
                "torch_attn.recurrent.LIGHTNING_IMPLEMENTATIONS"]


def resolve(name: str):
    """The object ``name`` ("package.module.attr" or "package.module:attr") stands for: the
    longest importable prefix, then attributes."""
    path, _, attr = name.partition(":")
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for part in parts[i:] + ([attr] if attr else []):
            obj = getattr(obj, part)
        return obj
    raise ModuleNotFoundError(name)


def test_the_docs_cite_names():
    assert len(CITED) > 30, CITED  # the pattern still finds what the pages cite


@pytest.mark.parametrize("name", sorted(set(CITED) | set(ENTRY_POINTS)))
def test_a_public_name_resolves(name):
    assert resolve(name) is not None


@pytest.mark.parametrize("old", sorted(golden.MOVED))
def test_a_module_name_from_before_the_rooms_is_the_same_module(old):
    """``golden.variants`` and ``golden.specification.variants`` are one module object, its own spec
    intact."""
    new = golden.MOVED[old]
    assert importlib.import_module(old) is importlib.import_module(new)
    assert importlib.import_module(old).__spec__.name == new


@pytest.mark.parametrize("first", ["old", "new"])
def test_either_name_imported_first_gives_one_module(first):
    """In a fresh interpreter, whichever name is imported first."""
    old, new = "golden.tolerances", golden.MOVED["golden.tolerances"]
    one, two = (old, new) if first == "old" else (new, old)
    code = (f"import importlib, sys; a = importlib.import_module({one!r}); "
            f"b = importlib.import_module({two!r}); "
            f"assert a is b and sys.modules[{old!r}] is sys.modules[{new!r}], 'two modules'; "
            f"assert a.__spec__.name == {new!r}, a.__spec__.name")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_unknown_old_name_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("golden.no_such_module")
