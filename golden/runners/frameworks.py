"""One adapter per framework for the harness: NumPy arrays in and out, the dtype map, and the
fixtures' loss. The runners (``golden.runners``), ``from_function``/``from_module``,
``golden.compare`` and the tests' twins all go through these, so a framework's conversions are
written once.

    ADAPTERS["torch"].leaves(arrays, "float32")   float arrays as float32 tensors that need
                                                   gradients; masks and integers as they are
    ADAPTERS["jax"].numpy(out)                     back to float64 NumPy (a copy)
    adapter.loss(cotangents, out, weights, dtype)  Σ out ⊙ dO (+ Σ weights ⊙ dA with weights)

Arrays going in are copies: nothing a caller holds is aliased by a tensor the harness writes
to. Each framework is imported when its adapter is first used, so an installation with one
framework runs that framework's checks.
"""

from __future__ import annotations

import contextlib
import importlib

import numpy as np

from golden.specification.validate import DTYPES


class Adapter:
    """NumPy ↔ one framework (the base is NumPy itself: forward only, no gradients)."""

    name = "numpy"
    dtypes = ("float32", "float64")  # what it computes in

    def dtype(self, name: str):
        """The framework's dtype called ``name`` (one of ``dtypes``)."""
        return np.dtype(name)

    def dtype_name(self, x) -> str:
        """The name of an array's dtype, as in DTYPES."""
        return str(np.dtype(x.dtype))

    def array(self, a, dtype=None):
        """A copy of NumPy ``a`` in the framework; a float array cast to ``dtype`` when given,
        masks and integers keeping theirs."""
        a = np.asarray(a)
        return a.astype(dtype) if dtype is not None and a.dtype.kind == "f" else a.copy()

    def leaves(self, arrays: dict, dtype) -> dict:
        """``arrays`` (name → NumPy) as the inputs of a differentiated call in ``dtype``."""
        return {n: self.array(a, dtype) for n, a in arrays.items()}

    def numpy(self, x):
        """A float64 NumPy copy of ``x`` (None stays None)."""
        return None if x is None else np.asarray(x, dtype=np.float64).copy()

    def loss(self, cotangents: dict, out, weights, dtype):
        """The fixtures' loss Σ out ⊙ dO + Σ weights ⊙ dA (the second term only with weights);
        cotangents NumPy (converted to ``dtype``) or already the framework's (traced ones)."""
        def cot(name):
            c = cotangents[name]
            return self.array(c, dtype) if isinstance(c, np.ndarray) else c

        total = (out * cot("output")).sum()
        if weights is not None:
            total = total + (weights * cot("weights")).sum()
        return total

    def float64(self, on=True):
        """A context in which ``on`` float64 arrays stay float64 (JAX needs it)."""
        return contextlib.nullcontext()


class _Torch(Adapter):
    name, dtypes = "torch", DTYPES

    @property
    def _torch(self):
        return importlib.import_module("torch")

    def dtype(self, name):
        if name not in self.dtypes:
            raise ValueError(f"dtype should be one of {', '.join(self.dtypes)}, got {name!r}")
        return getattr(self._torch, name)

    def dtype_name(self, x):
        return str(x.dtype).removeprefix("torch.")

    def array(self, a, dtype=None):
        t = self._torch.from_numpy(np.array(a, order="C"))  # a copy; 0-d stays 0-d
        return t.to(self.dtype(dtype)) if dtype is not None and t.is_floating_point() else t

    def leaves(self, arrays, dtype):
        out = {}
        for n, a in arrays.items():
            t = self.array(a, dtype)
            out[n] = t.requires_grad_() if t.is_floating_point() else t
        return out

    def numpy(self, x):
        return None if x is None else x.detach().cpu().to(self._torch.float64).numpy()


class _Jax(Adapter):
    name, dtypes = "jax", DTYPES

    def dtype(self, name):
        return importlib.import_module("jax.numpy").dtype(name)  # bfloat16 too (ml_dtypes)

    def dtype_name(self, x):
        return str(x.dtype)

    def array(self, a, dtype=None):
        a = np.asarray(a)
        a = a.astype(self.dtype(dtype)) if dtype is not None and a.dtype.kind == "f" else a
        a = _narrowed(a) if a.dtype.kind in "iu" and a.dtype.itemsize == 8 else a
        # device_put compiles nothing (jnp.asarray compiles a ``stage`` per new shape in jax
        # 0.10); it makes float64 float32 outside float64(), as jnp.asarray does.
        return importlib.import_module("jax").device_put(a)

    def numpy(self, x):
        return None if x is None else np.asarray(x).astype(np.float64)

    def float64(self, on=True):
        return importlib.import_module("jax").enable_x64(on)


def _narrowed(a):
    """A 64-bit integer array as the integers JAX computes in: int32 (uint32) without x64,
    converted here so that JAX does not warn of a truncation; ValueError naming the range when
    the values do not fit. Under x64 (``float64()``) it stays 64-bit."""
    target = np.dtype(importlib.import_module("jax").dtypes.canonicalize_dtype(a.dtype))
    if target == a.dtype:
        return a
    info = np.iinfo(target)
    if a.size and (a.min() < info.min or a.max() > info.max):
        raise ValueError(f"a {a.dtype} array with values in [{a.min()}, {a.max()}] does not fit "
                         f"{target}, which JAX uses without x64; enable x64 "
                         f"(jax.config.update('jax_enable_x64', True)) or pass smaller integers")
    return a.astype(target)


ADAPTERS = {a.name: a for a in (Adapter(), _Torch(), _Jax())}
NUMPY, TORCH, JAX = ADAPTERS["numpy"], ADAPTERS["torch"], ADAPTERS["jax"]
