"""The tests' own random draws (``tests.helpers.fresh_rng``): fixed seeds by default, the same on
every run, so that a failure reproduces; fresh ones on request (ATTN_PARITY_SEEDS=fresh)."""

from __future__ import annotations

import collections

import numpy as np

from tests import helpers


def test_fixed_seeds_repeat_on_every_run_and_differ_between_draws(monkeypatch):
    monkeypatch.setattr(helpers, "SEEDS", "fixed")
    monkeypatch.setattr(helpers, "_DRAWS", collections.Counter())
    first = [helpers.fresh_rng()[1] for _ in range(3)]
    monkeypatch.setattr(helpers, "_DRAWS", collections.Counter())  # a new run of this test
    again = [helpers.fresh_rng() for _ in range(3)]
    assert [seed for _, seed in again] == first
    assert len(set(first)) == 3
    rng, seed = again[0]
    assert rng.random() == np.random.default_rng(seed).random()  # the seed replays the draws
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_other.py::test_other (call)")
    assert helpers.fresh_rng()[1] not in first  # another test, other draws


def test_fresh_seeds_differ_on_every_call(monkeypatch):
    monkeypatch.setattr(helpers, "SEEDS", "fresh")
    seeds = {helpers.fresh_rng()[1] for _ in range(4)}
    assert len(seeds) == 4
