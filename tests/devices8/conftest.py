"""Tests that need 8 JAX devices: 8 virtual CPU devices, from the flag set before JAX starts.

``tests/test_devices8.py`` runs this directory in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``; the main session (one CPU device) does
not collect it (``tests/conftest.py``). To run it alone:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/devices8
"""

from __future__ import annotations

import jax
import pytest

DEVICES = 8


def pytest_collection_modifyitems(config, items):
    if jax.device_count() < DEVICES:
        reason = (f"needs {DEVICES} JAX devices, this process has {jax.device_count()}: set "
                  f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} before JAX starts")
        for item in items:
            item.add_marker(pytest.mark.skip(reason=reason))
