"""Every Python block of the README and of docs/*.md runs as written, so the examples stay
true, and imports nothing from ``tests/``, which an installed package lacks; links between the
pages resolve."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import matrix

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# {id: (page, block)}: "README-block0", "core-block3", ...
BLOCKS = {f"{page.stem}-block{i}": (page, block) for page in PAGES
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(),
                                               flags=re.S))}
# XLA reads its flags once, when JAX starts, and this session's JAX has started with one device:
# a block that sets them (8 virtual devices for a mesh) runs as a user would run it, in a fresh
# interpreter.
FRESH_JAX = "xla_force_host_platform_device_count"


def test_pages_have_examples():
    blocks = [b for _, b in BLOCKS.values()]
    assert len(blocks) >= 15  # the core, two per variant, the fixture round trip, ...
    assert sum(page.name == "README.md" for page, _ in BLOCKS.values()) >= 2  # one per framework
    assert any(FRESH_JAX in b for b in blocks)  # the mesh example, in a fresh interpreter
    assert any(page.name == "reproducibility.md" for page, _ in BLOCKS.values())


def test_no_page_holds_a_merge_conflict():
    """A merge's conflict markers left in a page (they are not Python, so no block fails)."""
    for page in PAGES:
        marked = re.findall(r"^(?:<{7}|>{7}) .*$|^={7}$", page.read_text(), flags=re.M)
        assert not marked, f"{page.name}: {marked}"


def test_links_between_pages_resolve():
    """Every relative link of the README and docs/ names a file that exists."""
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def _imported(block) -> list[str]:
    """The modules a block imports, inside functions too, as dotted names (``from x.y import
    z`` gives "x.y"; a relative ``from .y import z``, which no page should hold, ".y")."""
    names = []
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def _from_tests(block) -> list[str]:
    """What a block imports from the repository's ``tests`` (or relatively, from anywhere)."""
    return [n for n in _imported(block) if n.split(".")[0] in ("tests", "")]


def test_examples_import_nothing_from_tests():
    """An installed package has no ``tests/``: every example imports only what ships
    (``golden.examples`` holds the example ports)."""
    found = {key: _from_tests(block) for key, (_, block) in BLOCKS.items()}
    assert {key: names for key, names in found.items() if names} == {}


def test_the_tests_import_check_sees_every_form():
    planted = ("import tests.port_pair\nfrom tests import helpers\n"
               "from tests.hf_ports import GPT2_MAPPING\nfrom . import x\nimport testsuite\n"
               "def f():\n    from tests.port_bugs import MAPPING\n")
    assert _from_tests(planted) == ["tests.port_pair", "tests", "tests.hf_ports", ".",
                                    "tests.port_bugs"]


# A block that runs a whole check or comparison of a port (``check.run``, ``compare``,
# ``assert_impl``, ...), or a fresh interpreter, runs in the whole matrix: each takes seconds,
# and the quick suite runs what it shows in tests/test_check_impl.py, tests/test_compare*.py
# and tests/devices8. Every other block runs in both.
HEAVY = ("check.run(", "compare(", "check_port(", "assert_port(", "assert_impl(", FRESH_JAX)


@pytest.mark.parametrize("page, block", [
    pytest.param(page, block, id=key, marks=[matrix] if any(h in block for h in HEAVY) else [])
    for key, (page, block) in BLOCKS.items()])
def test_block_runs(page, block):
    if FRESH_JAX not in block:
        exec(compile(block, str(page), "exec"), {})
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]


def _commands():
    """(page, line) for every ``attn-parity`` command of the pages' bash blocks, continuation
    lines joined and comments dropped."""
    out = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if line.startswith("attn-parity "):
                    out.append((page.name, line))
    return out


def test_documented_commands_parse():
    """Every ``attn-parity`` command shown in a bash block is accepted by the command's parser
    (options and choices as documented; not run: they write files and take minutes). ``bench``
    parses its own options when it runs and is left out."""
    import shlex

    from golden.cli import parser

    commands = [(page, line) for page, line in _commands()
                if shlex.split(line)[1:2] != ["bench"]]
    assert len(commands) >= 20
    for page, line in commands:
        try:
            parser().parse_args(shlex.split(line)[1:])
        except SystemExit:
            pytest.fail(f"{page}: the documented command does not parse: {line}")
