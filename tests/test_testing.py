"""``golden.port.testing``: the assertions users put in their own suites."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from golden import compare as C
from golden.runners.adapt import NotSupported, from_function
from golden.port.testing import assert_impl, assert_port
from golden.examples import port_pair as P

X = {"x": (2, 5, 8)}  # B=2, L=5, E=8
WRONG = {**P.MAPPING, "k_proj.weight": "key.kernel"}  # the transpose left out (8 × 8: fits)


def _sdpa(query, key, value, *, scale=None):
    """softmax(q kᵀ · scale) v in NumPy, scale 1/√Dk by default."""
    s = query @ np.swapaxes(key, -1, -2) * (query.shape[-1] ** -0.5 if scale is None else scale)
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ value


def _unscaled(query, key, value):
    """The classic bug: scores not scaled by 1/√Dk."""
    return _sdpa(query, key, value, scale=1.0)


def test_assert_impl_passes_and_returns_the_report():
    report = assert_impl(from_function(_sdpa, "numpy", name="mine"), pattern="sdpa_plain")
    assert [(r["fixture"], r["dtype"], r["status"]) for r in report["rows"]] == [
        ("sdpa_plain", "float32", "pass"), ("sdpa_plain", "float64", "pass")]


def test_assert_impl_fails_with_the_failing_rows_table():
    with pytest.raises(AssertionError) as caught:
        assert_impl(from_function(_unscaled, "numpy", name="mine"), pattern="sdpa_plain",
                    dtypes=["float64"])
    lines = str(caught.value).splitlines()
    assert lines[0] == "1 of 1 rows failed (0 passed, 0 not supported):"
    assert lines[1].split() == ["fixture", "framework", "core", "dtype", "max", "abs", "err",
                                "max", "rel", "err", "worst", "err/bound", "result"]
    assert lines[3].startswith("sdpa_plain mine") and lines[3].endswith("FAIL output")
    err, bound = map(float, lines[3].split()[6].split("/"))
    # the float64 value row: elementwise 1e-14 + 1e-13·|eᵢ| (|e| ≤ 1 here), relative norm 1e-13
    assert err > 0.1 and 1e-14 <= bound <= 1e-13
    assert len(lines) == 4


def test_assert_impl_lists_errors_and_only_the_bad_rows():
    def flaky(query, key, value):
        if query.dtype == np.float32:
            raise RuntimeError("no float32 kernel")
        return _sdpa(query, key, value)

    with pytest.raises(AssertionError, match=r"(?s)1 of 2 rows failed \(1 passed.*"
                                             r"ERROR RuntimeError: no float32 kernel") as caught:
        assert_impl(from_function(flaky, "numpy", name="mine"), pattern="sdpa_plain")
    assert "float64" not in str(caught.value)  # the passing row is left out


def test_assert_impl_fails_when_nothing_ran():
    def refuses(fixture, dtype):
        raise NotSupported("not this one")

    refuses.name = "refuses"
    with pytest.raises(AssertionError, match="nothing ran: 2 rows selected, none supported"):
        assert_impl(refuses, pattern="sdpa_plain")
    with pytest.raises(ValueError, match="impls: assert_impl checks the one runner"):
        assert_impl(refuses, impls=[refuses])


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    report = assert_port(P.make_torch, P.make_flax, P.MAPPING, X, seed=3)  # keywords forwarded
    assert report.data["seed"] == 3
    return C.freeze(report, tmp_path_factory.mktemp("port") / "block.npz",
                    flax_factory_spec="golden.examples.port_pair:make_flax")


def test_assert_port_fails_with_the_reports_table():
    with pytest.raises(AssertionError) as caught:
        assert_port(P.make_torch, P.make_flax, WRONG, X)
    message = str(caught.value)
    expected = C.compare(P.make_torch, P.make_flax, WRONG, X).text()
    assert message == "the port does not match its reference:\n" + expected
    assert "first diverging submodule: k_proj ~ key" in message


def test_assert_port_checks_a_port_fixture(frozen):
    assert assert_port(fixture=frozen).ok
    with pytest.raises(AssertionError, match="FAIL: output"):
        assert_port(P.make_flax_wrong_key, fixture=frozen)  # flax_factory, forwarded


def test_golden_testing_does_not_import_pytest():
    code = "import sys, golden.port.testing; sys.exit('pytest' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
