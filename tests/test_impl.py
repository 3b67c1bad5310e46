"""The harness (``golden.harness.check.run`` over ``golden.runners.adapt`` runners) against a third
implementation, the NumPy port of ``tests/port_numpy.py``: the port passes every shipped fixture
it can run, and each mistake planted in it fails exactly the rows whose fixture can see that
mistake. Those rows are derived from each fixture's own configuration, inputs and expected
weights, never from a run.

Shape legend: B batch, H heads, Lq query length, Lk key length, Dk key width; weights are
(..., Lq, Lk).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import golden
import golden.harness.check
from tests import port_numpy
from tests.port_numpy import Attention

ROOT = Path(__file__).resolve().parents[1]
LOW = ("bfloat16", "float16")   # NumPy has no bfloat16: the port runs float32 and float64
CAUGHT = ("fail", "error")
UNSCALED = ("simple_self_attention",)  # softmax(X Xᵀ) X by definition: scale 1, never defaulted


# ---- the planted mistakes: one hook of the port overridden, or one mapping rule dropped --------

class WrongScale(Attention):
    def default_scale(self, dk):
        return 1.0 / dk


class FlippedMask(Attention):
    def user_mask(self, mask):
        return ~mask  # True = blocked


class Float32Softmax(Attention):
    def softmax(self, scores, allowed):
        return super().softmax(scores.astype(np.float32), allowed).astype(scores.dtype)


class NoDropoutScale(Attention):
    def dropout_scale(self, rate):
        return 1.0


class BottomRight(Attention):
    def causal_bound(self, position, lq, lk):
        return position + (lk - lq)


def untransposed_query(variant, config) -> dict:
    """The port's mapping with W_query's layout rule dropped (loaded as stored, (in, out))."""
    table = port_numpy.mapping(variant, config)
    if "W_query" in table:
        table["W_query"] = (table["W_query"][0], "")
    return table


# ---- which (fixture, dtype) rows can see each mistake, from the fixture alone ------------------
# A recurrent mixer's fixture (no expected weights) calls no attention core: no softmax, scale,
# dropout or causal mistake reaches it (a flipped mask and the untransposed W_query do).

def _attends(f) -> bool:
    """The fixture's variant runs the attention core (it has attention weights)."""
    return "weights" in f.expected


def _scale_matters(f, dtype) -> bool:
    """(a) The default scale is in force (no scale in the config; not SimpleSelfAttention) and
    some row of the expected weights has two non-zero weights that differ, so its scores differ
    and rescaling them changes the softmax."""
    if not _attends(f) or f.variant in UNSCALED or f.config.get("scale") is not None:
        return False
    w = f.expected["weights"].reshape(-1, f.expected["weights"].shape[-1])  # (rows, Lk)
    kept = w != 0
    spread = np.where(kept, w, -np.inf).max(-1) > np.where(kept, w, np.inf).min(-1)
    return bool(np.any((kept.sum(-1) >= 2) & spread))


def _has_query_weight(f, dtype) -> bool:
    """(b) The fixture has a W_query to load."""
    return "W_query" in f.params


def _square_query(f) -> bool:
    """W_query (…, in, out) with in = out: loaded untransposed it still fits (a "fail");
    otherwise the mapping's shape check refuses it (an "error")."""
    return f.params["W_query"].shape[-1] == f.params["W_query"].shape[-2]


def _has_mask(f, dtype) -> bool:
    """(c) A mask input. Any mask sees a flipped polarity, even an all-True one (flipped, it
    blocks every key: zeros); none of the shipped masks is all True or all False anyway. A
    merged_context fixture too: its causal and context masks reach the core as its mask. A
    recurrent mixer's padding mask too (the port reads it through the core's hook). A learned
    indexer's fixture too (tokens or blocks): the keys it chose reach the core as the mask."""
    return ("mask" in f.inputs or bool(f.config.get("merged_context"))
            or f.config.get("index_topk") is not None
            or f.config.get("index_blocks") is not None)


def _is_float64(f, dtype) -> bool:
    """(d) Every float64 row with a softmax: a float32 one is far outside the 1e-13
    tolerance."""
    return dtype == "float64" and _attends(f)


def _drops(f, dtype) -> bool:
    """(e) A keep-mask applied at a non-zero rate (the core's dropout_rate, a module's dropout:
    the keep-mask puts it in training mode), keeping some non-zero weight."""
    rate = f.config.get("dropout_rate", f.config.get("dropout", 0.0))
    return "dropout_mask" in f.inputs and rate > 0 and bool(np.any(f.expected["weights"]))


def _alignment_matters(f, dtype) -> bool:
    """(f) The core's causal fixtures with Lq ≠ Lk. Module fixtures never: they are
    self-attention (Lq = Lk, where both alignments agree) or cross attention (never causal).
    With Lk > Lq the bottom-right bound opens, to query row i, keys i + offset + 1 … i + offset
    + Lk − Lq; row 0 opens key offset + 1, seen unless the key lengths (or Lk) end before it.
    So the naive "causal and Lq ≠ Lk" is narrowed: it would name sdpa_mqa_decode_ragged, a
    decode step whose key_value_seq_lengths = query_offset + 1 ([9, 6] for offsets [8, 5])
    leave no key past the top-left bound to open."""
    if not _attends(f) or not f.config.get("is_causal"):
        return False
    lq, lk = f.expected["weights"].shape[-2:]
    if lq == lk:
        return False
    offset = f.inputs.get("query_offset", 0)
    reach = np.minimum(f.inputs.get("key_value_seq_lengths", lk), lk)
    return lk < lq or bool(np.any(offset + 1 < reach))


MUTANTS = {  # name: (runner keywords, which rows catch it)
    "wrong_scale": (dict(core=WrongScale()), _scale_matters),
    "untransposed_query": (dict(table=untransposed_query), _has_query_weight),
    "flipped_mask": (dict(core=FlippedMask()), _has_mask),
    "float32_softmax": (dict(core=Float32Softmax()), _is_float64),
    "no_dropout_scale": (dict(core=NoDropoutScale()), _drops),
    "bottom_right_causal": (dict(core=BottomRight()), _alignment_matters),
}


# ---- shared runs --------------------------------------------------------------------------------

def _rows(runner) -> dict:
    """{(fixture, dtype): row} of the runner over every shipped fixture."""
    report = golden.harness.check.run(impls=[runner], progress=False)
    rows = [r for r in report["rows"] if r["implementation"] == runner.name]
    return {(r["fixture"], r["dtype"]): r for r in rows}


@pytest.fixture(scope="module")
def shipped():
    return {name: golden.load(name) for name in golden.names()}


@pytest.fixture(scope="module")
def correct_rows():
    return _rows(port_numpy.RUNNER)


@pytest.fixture(scope="module", params=list(MUTANTS))
def mutant(request):
    """(name, which rows catch it, the mutant's rows)."""
    keywords, catches = MUTANTS[request.param]
    return request.param, catches, _rows(port_numpy.runner(**keywords))


# ---- the correct port --------------------------------------------------------------------------

def test_port_passes_every_fixture(shipped, correct_rows):
    assert set(correct_rows) == {(n, d) for n, f in shipped.items() for d in f.dtypes}
    for (name, dtype), row in correct_rows.items():
        want = "not supported" if dtype in LOW else "pass"
        assert row["status"] == want, (name, dtype, row["reason"])
    passed = {name for (name, _), row in correct_rows.items() if row["status"] == "pass"}
    assert passed == set(shipped)


def test_port_compares_output_and_weights(shipped, correct_rows):
    """Forward-only: output and weights are compared, never a gradient (a recurrent mixer's
    output alone: it has no weights)."""
    for row in correct_rows.values():
        if row["status"] == "pass":
            want = ["output", "weights"] if _attends(shipped[row["fixture"]]) else ["output"]
            assert [a["name"] for a in row["arrays"]] == want, row["fixture"]


def test_command_line_runs_the_port():
    """``attn-parity check --impl tests.port_numpy:RUNNER``: exit 0 (0.6 s of wall time here,
    220 NumPy rows pass, 22 low-precision rows not supported).
    ``python -m golden`` is ``attn-parity regenerate`` (README), so the command's own module
    runs it, with this interpreter, from the repository root."""
    done = subprocess.run([sys.executable, "-m", "golden.cli", "check", "--impl",
                           "tests.port_numpy:RUNNER"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "numpy-port" in done.stdout


class Recording(Attention):
    """The port's core, noting the dtypes its softmax and its results come in."""

    def __init__(self):
        self.seen = set()

    def softmax(self, scores, allowed):
        self.seen.add(("softmax", scores.dtype.name))
        return super().softmax(scores, allowed)

    @functools.wraps(Attention.sdpa)  # the harness reads the keywords it takes from it
    def sdpa(self, *args, **keywords):
        out, weights = super().sdpa(*args, **{**keywords, "return_weights": True})
        self.seen |= {("output", out.dtype.name), ("weights", weights.dtype.name)}
        return (out, weights) if keywords.get("return_weights") else out


def test_port_computes_in_float32_in_a_float32_run():
    """No silent float64 anywhere on the way to the softmax or out of the core."""
    core = Recording()
    report = golden.harness.check.run(impls=[port_numpy.runner(core=core)], dtypes=("float32",),
                              progress=False)
    assert {r["status"] for r in report["rows"]} == {"pass"}
    assert core.seen == {("softmax", "float32"), ("output", "float32"), ("weights", "float32")}


# ---- the planted mistakes ----------------------------------------------------------------------

def test_mutant_fails_exactly_the_rows_that_see_it(shipped, mutant):
    name, catches, rows = mutant
    expected = {(n, d) for n, f in shipped.items() for d in f.dtypes
                if d not in LOW and catches(f, d)}
    assert expected, f"{name}: no fixture can catch it"
    for (fixture, dtype), row in rows.items():
        if dtype in LOW:
            want = ("not supported",)
        else:
            want = CAUGHT if (fixture, dtype) in expected else ("pass",)
        assert row["status"] in want, (name, fixture, dtype, row["status"], row["reason"])


def test_failing_rows_name_what_failed(mutant):
    name, _, rows = mutant
    for row in rows.values():
        if row["status"] == "fail":
            bad = [a["name"] for a in row["arrays"] if not a["ok"]]
            assert bad and set(bad) <= {"output", "weights"}, (name, row["fixture"])
            assert all(b in row["reason"] for b in bad), (name, row["fixture"], row["reason"])


def test_untransposed_query_errors_unless_square(shipped):
    """W_query loaded as stored: a square one loads and computes the wrong thing ("fail"),
    any other one is refused by the mapping's shape check, which names it ("error")."""
    rows = _rows(port_numpy.runner(table=untransposed_query))
    for (fixture, dtype), row in rows.items():
        f = shipped[fixture]
        if dtype in LOW or "W_query" not in f.params:
            continue
        if _square_query(f):
            assert row["status"] == "fail" and "output" in row["reason"], row
        else:
            assert row["status"] == "error" and "W_query" in row["reason"], row
