"""Every Python block of the README and of docs/*.md runs as written, so the examples stay
true."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
DOCS = {f"{path.stem}-block{i}": block for path in sorted((ROOT / "docs").glob("*.md"))
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(),
                                             flags=re.S))}
# XLA reads its flags once, when JAX starts, and this session's JAX has started with one device:
# a block that sets them (8 virtual devices for a mesh) runs as a user would run it, in a fresh
# interpreter.
FRESH_JAX = "xla_force_host_platform_device_count"


def test_readme_has_examples():
    assert len(BLOCKS) >= 13  # the core, two per variant, the fixture round trip
    assert any(FRESH_JAX in b for b in BLOCKS)  # the mesh example, in a fresh interpreter


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(block):
    if FRESH_JAX not in block:
        exec(compile(block, str(README), "exec"), {})
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]


def test_docs_have_examples():
    assert any(n.startswith("reproducibility-") for n in DOCS)


@pytest.mark.parametrize("block", DOCS.values(), ids=DOCS.keys())
def test_docs_block_runs(block):
    exec(compile(block, "docs", "exec"), {})
