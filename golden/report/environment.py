"""The environment block of a report: Python, the platform, each package's version (null where
it is not installed) and, when this process imported JAX, its backend and devices
(``environment``). JAX is never imported here."""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import numpy as np

PACKAGES = ("torch", "jax", "jaxlib", "flax", "optax", "matplotlib")


def environment() -> dict:
    """Python, platform and package versions (null where not installed), and JAX's backend and
    devices if this process imported JAX (null otherwise; JAX is never imported here)."""
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "machine": platform.machine(), "numpy": np.__version__}
    env.update({name: _version(name) for name in PACKAGES})
    env["attn_parity"] = _version("attn-parity")
    env["jax_backend"], env["devices"] = _jax_devices()
    return env


def _version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _jax_devices() -> tuple[str | None, list[str] | None]:
    """(backend, devices) of an already imported JAX, else (None, None)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None, None
    try:
        return jax.default_backend(), [str(d) for d in jax.devices()]
    except RuntimeError:  # no backend could be initialised
        return None, None
