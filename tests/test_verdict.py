"""The verdict machinery itself: what makes a run fail, which gradient a comparison blames, the
bound each element is held to, and how not-supported rows are reported. Each test names the
planted bug it catches: a mistake that, alone, passed every other test.

Shape legend: B batch, N query heads, Nkv key-value heads, L sequence length, Dh head width.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from golden.harness import check

from golden import cli, report

from golden.specification import positions, validate, variants
from golden import compare as C
from golden.harness.check import compare_all
from golden.runners.adapt import as_runner, from_function
from golden.specification.tolerances import TOLERANCES, compare_terms
from golden.examples import port_pair as P
from tests.helpers import fresh_rng, random_cotangents, reference_fixture


def _sdpa(query, key, value):
    """Plain attention in NumPy, (B, N, Lq, Dk) × (B, N, Lk, Dk) × (B, N, Lk, Dv)."""
    scores = query @ np.swapaxes(key, -1, -2) / math.sqrt(query.shape[-1])  # (B, N, Lq, Lk)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True) @ value


def _crash(query, key, value):
    raise RuntimeError("the port crashed")


def _lacking(query, key, value, **keywords):
    """A port that runs plain attention and says, by NotImplementedError, what else it lacks."""
    if keywords:
        raise NotImplementedError(f"no {', '.join(sorted(keywords))}")
    return _sdpa(query, key, value)


CRASHING = from_function(_crash, "numpy", name="crashing")
LACKING = from_function(_lacking, "numpy", name="lacking")


# ---- a. an error fails the run ----------------------------------------------------------------

def test_a_port_that_raises_is_an_error_and_the_run_fails(capsys):
    # Catches golden/harness/check.py's _summary computing "ok" without count["error"]: a run whose
    # every row raised would be reported ok, and `check --impl` would exit 0.
    run = check.run(["sdpa_plain"], impls=[CRASHING])
    assert [(r["status"], r["reason"]) for r in run["rows"]] == 2 * [
        ("error", "RuntimeError: the port crashed")]
    assert (run["summary"]["errors"], run["summary"]["ok"]) == (2, False)
    assert check.main(["sdpa_plain"], impls=[CRASHING], log=lambda line: None) == 1
    assert cli.main(["check", "sdpa_plain", "--impl", "tests.test_verdict:CRASHING"]) == 1
    assert "0 passed, 2 failed (2 of them errors)" in capsys.readouterr().out


# ---- b. compare blames the gradient that fails ------------------------------------------------

class _DetachedBias(nnx.Linear):
    """nnx.Linear whose bias gets no gradient: the output is right, that one gradient zero."""

    def __call__(self, x):
        return (jnp.matmul(x, self.kernel[...], precision=P.HIGHEST)
                + jax.lax.stop_gradient(self.bias[...]))


def _flax_detached_value_bias():
    block = P.make_flax()
    block.value = _DetachedBias(P.E, P.E, precision=P.HIGHEST, rngs=nnx.Rngs(1))
    return block


def test_compare_names_exactly_the_one_gradient_that_fails():
    # Catches golden/compare/verdict.py's _report pairing the mapping's keys with zip(table, rows)
    # instead of zip(table, rows[1:]): rows[0] is the output, so the failing grad v_proj.bias
    # (row 6) would be reported as the 7th key, o_proj.weight.
    got = C.compare(P.make_torch, _flax_detached_value_bias, P.MAPPING, {"x": (2, 5, 8)})
    ok = {r["what"]: r["ok"] for r in got.rows}
    assert ok["output"] and ok["grad input x"]
    assert [w for w, passed in ok.items() if w.startswith("grad ") and not passed] == [
        "grad v_proj.bias"]
    assert got.failing_params == ["v_proj.bias"]
    assert got.text().splitlines()[-1] == "FAIL: grad v_proj.bias"


# ---- c. compare_terms holds each element to its own term size -----------------------------------

def test_compare_terms_bounds_each_element_by_its_own_terms():
    # Catches golden/specification/tolerances.py's compare_terms bounding every element by rtol ·
    # max(M)
    # instead of rtol · Mᵢ: an element whose terms are small would get the large elements'
    # bound. By the documented formula, float32 values (rel_norm 1e-6, rtol 1e-5, atol 1e-6):
    #   |aᵢ − eᵢ| ≤ atol · max(1, max M) · √terms + rtol · Mᵢ
    #   ‖a − e‖ ≤ rel_norm · ‖M‖ + tiny · √n
    # Here e = 0.5 everywhere (8 × 8), M = 1000 everywhere but one element where M = 1:
    #   atol' = 1e-6 · 1000 = 1e-3;  bound = 1e-3 + 1e-5 · 1000 = 0.011 where M = 1000,
    #   1e-3 + 1e-5 · 1 = 0.00101 where M = 1;  the norm bound is 1e-6 · √(63e6 + 1) ≈ 0.0079.
    # An error of 0.005 in one element (over compare's table: 1e-6 + 1e-5 · 0.5) is then inside
    # the norm bound, inside the bound where M = 1000, and outside it where M = 1.
    tol = TOLERANCES["float32", "value"]
    e, m = np.full((8, 8), 0.5), np.full((8, 8), 1000.0)
    m[3, 5] = 1.0
    small, large = tol.atol * 1000 + tol.rtol * 1, tol.atol * 1000 + tol.rtol * 1000
    assert (small, large) == pytest.approx((0.00101, 0.011))
    assert tol.rel_norm * np.linalg.norm(m) == pytest.approx(0.0079373, rel=1e-4)

    def off(where, delta):
        a = e.copy()
        a[where] += delta
        return compare_terms(a, e, m, "float32")

    beside_large = off((0, 0), 0.005)
    assert (beside_large.ok, beside_large.rule) == (True, "terms")
    assert beside_large.bound_abs == pytest.approx(large)
    beside_small = off((3, 5), 0.005)  # within rtol · max(M), outside rtol · Mᵢ
    assert (beside_small.ok, beside_small.rule) == (False, "terms")
    assert (beside_small.abs_err, beside_small.bound_abs) == pytest.approx((0.005, small))
    within_small = off((3, 5), 0.0005)  # inside its own bound
    assert (within_small.ok, within_small.rule) == (True, "terms")


# ---- d. the l2 QK norm comes after RoPE -------------------------------------------------------

GQA = "grouped_query_attention"
YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
        "original_max_position_embeddings": 8}
L2_YARN = {"d_in": 5, "num_heads": 4, "num_kv_heads": 2, "head_dim": 6, "d_out": 3,
           "qk_norm": "l2", "rope_parameters": YARN}


def test_l2_qk_norm_after_yarn_rope_matches_the_reference(twin):
    # Catches either twin applying Llama 4's "l2" QK norm before RoPE instead of after it. Every
    # fixture's RoPE has attention factor 1, a rotation, which keeps the norm; YaRN's factor
    # m = 0.1 · ln 4 + 1 ≈ 1.139 scales the rotated q and k, so normalising before RoPE leaves
    # scores m² larger than normalising after.
    settings = validate.rope_settings(rope_parameters=YARN)
    assert positions.rope_frequencies(settings, L2_YARN["head_dim"])[1] == pytest.approx(
        0.1 * math.log(4) + 1)
    rng, seed = fresh_rng()
    shapes = variants.get(GQA).param_shapes(L2_YARN)
    params = {n: rng.standard_normal(s) for n, s in shapes.items()}
    x = rng.standard_normal((2, 7, 5))  # (B, L, d_in)
    cot = random_cotangents(rng, (2, 7, 3), (2, 4, 7, 7))  # dO (B, L, d_out), dA (B, N, L, L)
    fixture = reference_fixture(GQA, L2_YARN, {"x": x}, params, cot, "float64")
    with twin.float64():
        result = twin.run_with_grads(twin.build(GQA, L2_YARN, params), fixture, "float64")
    comps = compare_all(fixture, result, "float64")
    assert set(comps) == {"output", "weights", "grad x", *(f"grad {n}" for n in params)}
    bad = {what: c for what, c in comps.items() if not c.ok}
    assert not bad, f"{twin.name}, seed {seed}: {bad}"


# ---- not supported: NotImplementedError, the digest, --hide-unsupported -------------------------

def test_not_implemented_error_is_not_supported_with_its_message():
    run = check.run(["sdpa_plain", "sdpa_mask_bias"], impls=[LACKING])
    assert [(r["fixture"], r["status"], r["reason"]) for r in run["rows"]] == [
        ("sdpa_plain", "pass", None), ("sdpa_plain", "pass", None),
        *2 * [("sdpa_mask_bias", "not supported", "NotImplementedError: no bias, mask")]]
    assert run["summary"]["ok"] and run["summary"]["not_supported"] == 2


def test_not_implemented_error_without_a_message_is_named():
    def bare(fixture, dtype):
        raise NotImplementedError

    run = check.run(["sdpa_plain"], impls=[as_runner(bare, "bare")])
    assert {(r["status"], r["reason"]) for r in run["rows"]} == {
        ("not supported", "NotImplementedError")}


UNSUPPORTED = ["sdpa_plain", "sdpa_mask", "sdpa_causal_square", "sdpa_causal_rect",
               "sdpa_mask_bias", "sdpa_wide_key"]
DIGEST = ["not supported (8 rows), by reason:",
          '  4 × "NotImplementedError: no is_causal"',
          '  2 × "NotImplementedError: no mask"',
          '  2 × "NotImplementedError: no bias, mask"',
          "4 passed, 0 failed (8 not supported)"]


def _check(**options):
    """(exit status, the table's verdicts, every line printed) of LACKING on UNSUPPORTED."""
    lines = []
    code = check.main(UNSUPPORTED, impls=[LACKING], log=lines.append, **options)
    verdicts = ["not supported" if "not supported:" in line else line.split()[-1]
                for line in lines if line.startswith("sdpa_")]
    return code, verdicts, lines


def test_check_sums_up_the_not_supported_reasons_after_the_table():
    code, verdicts, lines = _check()
    assert code == 0
    assert verdicts == 2 * ["pass"] + 8 * ["not supported"] + 2 * ["pass"]
    assert lines[-len(DIGEST):] == DIGEST


def test_hide_unsupported_leaves_those_rows_out_of_the_table():
    code, verdicts, lines = _check(hide_unsupported=True)
    assert code == 0
    assert verdicts == 4 * ["pass"]
    assert lines[-len(DIGEST):] == DIGEST


def test_hide_unsupported_on_the_command_line(capsys):
    argv = ["check", *UNSUPPORTED, "--impl", "tests.test_verdict:LACKING", "--hide-unsupported"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out if line.startswith("sdpa_")] == [
        "sdpa_plain", "sdpa_plain", "sdpa_wide_key", "sdpa_wide_key"]
    assert out[-len(DIGEST):] == DIGEST


def test_hide_unsupported_when_nothing_ran():
    lines = []
    assert check.main(["sdpa_mask"], impls=[LACKING], hide_unsupported=True,
                      log=lines.append) == 2
    assert lines == ["not supported (2 rows), by reason:", '  2 × "NotImplementedError: no mask"',
                     "0 passed, 0 failed (2 not supported)",
                     "nothing ran: every selected row is not supported by the implementation"]


# ---- JUnit case names -------------------------------------------------------------------------

def test_junit_case_names_are_single_spaced(tmp_path):
    run = check.run(["sdpa_plain", "sdpa_mask"], impls=[LACKING])
    assert {r["core"] for r in run["rows"]} == {""}  # a NumPy port records no core
    root = ET.parse(report.write_junit(run, tmp_path / "junit.xml")).getroot()
    names = [c.get("name") for c in root.iter("testcase")]
    assert names == 2 * ["lacking float32", "lacking float64"]
