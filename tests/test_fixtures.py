"""Each framework against every golden fixture, float32 and float64; the regeneration check."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import golden
from golden import runners
from golden.specification import variants
from golden.specification.cases import CASES
from golden.harness.check import compare_all
from golden.harness.regenerate import regenerate
from golden.specification.tolerances import compare
from tests.helpers import (DTYPES, TWINS, fixture_features, fixture_of, matrix, missing_option,
                           sweep)


def test_every_case_is_shipped():
    assert golden.names() == sorted(c.name for c in CASES)


RUNS = [(name, dtype) for name in golden.names() for dtype in fixture_of(name).dtypes]


def test_every_fixture_runs_at_float32_and_float64():
    assert {dtype for name, dtype in RUNS if name == "sdpa_plain"} == set(DTYPES)
    assert all({(n, d) for d in DTYPES} <= set(RUNS) for n, _ in RUNS)


def test_runners_cover_every_framework():
    assert runners.FRAMEWORKS == ("reference", *TWINS)
    assert runners.get("reference") is runners.run_reference
    with pytest.raises(ValueError, match="framework should be one of reference, torch, jax, "
                                         "got 'tensorflow'"):
        runners.get("tensorflow")


# Each twin runs in the quick suite a covering few of the fixture runs, which hold every
# variant, dtype, option and input kind (tests/helpers.py ``sweep``), and every run in the whole
# matrix (test_reference_reproduces_fixture below holds every fixture to the reference).
TWIN_RUNS = [p for t in TWINS for p in sweep(
    [pytest.param(t, n, d, id=f"{t}-{n}-{d}") for n, d in RUNS],
    [fixture_features(fixture_of(n), d) for n, d in RUNS])]


@pytest.mark.parametrize("twin_name, fixture_name, dtype", TWIN_RUNS)
def test_framework_matches_fixture(twin_name, fixture_name, dtype):
    twin = TWINS[twin_name]
    fixture = golden.load(fixture_name)
    assert fixture.name == fixture_name and fixture.path.stem == fixture_name
    if missing_option(twin_name, fixture):
        pytest.skip(missing_option(twin_name, fixture))
    result = runners.get(twin.name)(fixture, dtype)
    assert result["dtype"] == dtype, "the computation ran in another dtype"
    assert set(result["grads"]) == set(fixture.grads), "a gradient was not computed"
    comps = compare_all(fixture, result, dtype)
    bad = {what: c for what, c in comps.items() if not c.ok}
    assert not bad, f"{twin.name} {dtype} {fixture_name}: {bad}"


def test_reference_reproduces_fixture(fixture_name):
    fixture = golden.load(fixture_name)
    result = runners.run_reference(fixture)
    np.testing.assert_array_equal(result["output"], fixture.expected["output"])
    assert ("weights" in result) == ("weights" in fixture.expected)  # a mixer has none
    assert ("key_indices" in result) == ("key_indices" in fixture.expected)  # an indexer's
    if "key_indices" in result:
        np.testing.assert_array_equal(result["key_indices"], fixture.expected["key_indices"])
    if "weights" in result:
        np.testing.assert_array_equal(result["weights"], fixture.expected["weights"])
    for n, g in fixture.grads.items():
        np.testing.assert_array_equal(result["grads"][n], g)


def test_float64_run_does_not_leak_x64():
    runners.get("jax")(golden.load("sdpa_plain"), "float64")
    assert jax.numpy.asarray(np.ones(2)).dtype == np.float32


@matrix  # the quick suite has each fixture's check (test_reference_reproduces_fixture) and
# regenerate's --check path (tests/test_fixture_format.py); this is their sum, once more
def test_regenerate_check_is_clean():
    lines = []
    assert regenerate(check=True, log=lines.append) == 0, "\n".join(lines)


# Those torch's "fused" takes (its registry's rule: not dropout nor soft-capping).
FUSED_RUNS = [(n, d) for n, d in RUNS if not runners.refuses("torch", "fused", fixture_of(n))
              and not missing_option("torch", fixture_of(n))]


@pytest.mark.parametrize("fixture_name, dtype", FUSED_RUNS, ids=[f"{n}-{d}" for n, d in FUSED_RUNS])
def test_torch_fused_forward_matches_fixture(fixture_name, dtype, monkeypatch):
    """A forward pass that needs neither weights nor gradients runs torch's fused kernel."""
    torch_twin = TWINS["torch"]
    calls = []
    fused = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or fused(*a, **k))
    fixture = golden.load(fixture_name)
    variant = variants.get(fixture.variant)
    args, kwargs = variant.call_args(torch_twin.arrays(fixture.inputs, dtype))
    if variant.is_module:
        call = torch_twin.cast(torch_twin.build(fixture.variant, fixture.config, fixture.params),
                               dtype).eval()
    else:
        call, kwargs = torch_twin.sdpa, {**kwargs, **fixture.config}
    with torch.no_grad():
        out = call(*args, **kwargs)
    assert calls, "the fused kernel did not run"
    assert compare(torch_twin.numpy(out), fixture.expected["output"], dtype).ok


def test_the_quick_suite_runs_every_behaviour_of_the_jax_runs():
    """The JAX runs the quick suite keeps (those not marked matrix) hold every variant, dtype,
    config option and input kind that all of them hold (tests/helpers.py ``sweep``)."""
    jax_runs = [p for p in TWIN_RUNS if p.values[0] == "jax"]
    kept = [p for p in jax_runs if not any(m.name == "matrix" for m in p.marks)]
    assert 0 < len(kept) < len(jax_runs)

    def held(params):
        return set().union(*(fixture_features(golden.load(p.values[1]), p.values[2])
                             for p in params))
    assert held(kept) == held(jax_runs)
    assert {p.values[2] for p in kept} == {p.values[2] for p in jax_runs}  # every dtype
