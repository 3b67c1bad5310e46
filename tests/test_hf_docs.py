"""docs/hf.md's family table against the code and the tests: it lists exactly the model_types
golden.hf converts, once each, and each row's test file holds that model_type's tiny model."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from golden.hf import FAMILIES, LINEAR

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _rows():
    """{model_type: test file} of the table's rows."""
    text = (ROOT / "docs" / "hf.md").read_text()
    rows = re.findall(r"^\| `([a-z0-9_-]+)` \|.*\| (test_hf_import\w*\.py) \|$", text, flags=re.M)
    return rows


LINEAR_TESTS = "test_hf_import_linear.py"  # the linear-attention layers' table's rows


def test_the_table_lists_every_supported_family_once():
    names = [name for name, f in _rows() if f != LINEAR_TESTS]
    assert len(names) == len(set(names)), "a family listed twice"
    assert set(names) == set(FAMILIES)


def test_the_linear_table_lists_every_linear_family_once():
    names = [name for name, f in _rows() if f == LINEAR_TESTS]
    assert len(names) == len(set(names)), "a family listed twice"
    assert set(names) == set(LINEAR)


@pytest.mark.parametrize("name, test_file", _rows())
def test_each_row_is_tested_where_it_says(name, test_file):
    module = importlib.import_module(f"tests.{Path(test_file).stem}")
    assert name in module.FAMILIES, f"{name} has no tiny model in {test_file}"
