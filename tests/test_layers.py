"""The packages' layers: imports point down, and each framework's twin works without the other.

Bottom, the neutral part: argument checks, variant descriptions, fixture format and loader, the
reference (float64, and exact decimal arithmetic), the tolerance table and the case list. NumPy
and the standard library only.
Middle: ``torch_attn`` (torch) and ``jax_attn`` (JAX, Flax); each imports only the bottom.
Top, the harness: check, regenerate, runners, command line, benchmarks, the worked examples
(``golden.examples``: torch modules and their Flax ports). Anything.
The bottom by room: ``golden.specification``, ``golden.reference`` and the Hugging Face
importer ``golden.hf`` whole, and the converters of ``golden.convert``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The bottom by room: the specification, its reference and the Hugging Face importer whole, the
# package's face and the NumPy-only converters.
BOTTOM_ROOMS = ("golden.specification", "golden.reference", "golden.hf")
BOTTOM = {"golden", "golden.convert"}
# Everything else of golden is on top: the harness, the runners, the reports, the tools for a
# user's port, compare, the verifier, the benchmark, the command line, the worked examples.
THIRD_PARTY = {"bottom": {"numpy"}, "torch_attn": {"numpy", "torch"},
               "jax_attn": {"numpy", "jax", "flax"}}


def _modules():
    """{dotted name: path} of every module in the three packages."""
    found = {}
    for package in ("golden", "torch_attn", "jax_attn"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _layer(name) -> str:
    if name.split(".")[0] in ("torch_attn", "jax_attn"):
        return name.split(".")[0]
    if name in BOTTOM or name.split(".")[:2] in ([*r.split(".")] for r in BOTTOM_ROOMS):
        return "bottom"
    return "top"


def _imports(name, path):
    """Every module ``name`` imports (inside functions too), as dotted names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for a in node.names:  # `from golden import reference` imports golden.reference
                yield f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base


def _allowed(importer_layer, imported) -> bool:
    top = imported.split(".")[0]
    if top in sys.stdlib_module_names or top == "__future__":
        return True
    if imported in MODULES or top in ("golden", "torch_attn", "jax_attn"):
        target = _layer(imported if imported in MODULES else top)
        if importer_layer == "top":
            return True
        return target == "bottom" or target == importer_layer
    return importer_layer == "top" or top in THIRD_PARTY[importer_layer]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
    layer = _layer(name)
    bad = [i for i in _imports(name, MODULES[name]) if not _allowed(layer, i)]
    assert not bad, f"{name} ({layer} layer) imports {bad}"


def test_the_layer_rule_catches_an_upward_edge():
    assert not _allowed("bottom", "golden.harness.check")
    assert not _allowed("bottom", "torch")
    assert not _allowed("jax_attn", "torch_attn.functional")
    assert not _allowed("torch_attn", "jax")
    assert not _allowed("torch_attn", "golden.runners")
    assert _allowed("top", "torch_attn") and _allowed("jax_attn", "golden.specification.validate")


def _run_without(blocked, code):
    """Run ``code`` in a fresh interpreter in which importing ``blocked`` fails."""
    prelude = textwrap.dedent(f"""
        import sys

        class Absent:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {blocked!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

        sys.meta_path.insert(0, Absent())
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_jax_side_works_without_torch():
    done = _run_without({"torch"}, """
        import golden, jax, jax_attn
        from flax import nnx
        from golden.harness.check import main
        module = jax_attn.MultiHeadAttention(4, 6, num_heads=2, rngs=nnx.Rngs(0))
        assert module(jax.numpy.ones((2, 5, 4))).shape == (2, 5, 6)
        assert main(pattern="sdpa_plain") == 0
        assert "torch" not in sys.modules
    """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipped torch: the torch runner needs torch" in done.stdout
    assert "sdpa_plain" in done.stdout and "2 passed, 0 failed" in done.stdout  # float32, 64
    assert "reproduces 1 of 1 fixtures bit for bit" in done.stdout


def test_torch_side_works_without_jax():
    done = _run_without({"jax", "jaxlib", "flax"}, """
        import golden, torch, torch_attn
        from golden.harness.check import main
        module = torch_attn.MultiHeadAttention(4, 6, num_heads=2)
        assert module(torch.ones(2, 5, 4)).shape == (2, 5, 6)
        assert main(pattern="sdpa_plain") == 0
        assert not {"jax", "flax"} & set(sys.modules)
    """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipped jax: the jax runner needs jax" in done.stdout
    assert "4 passed, 0 failed" in done.stdout  # autograd and fused, float32 and float64
