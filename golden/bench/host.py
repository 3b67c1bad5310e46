"""The host and the instruction sets in use on it: the CPU's flags (/proc/cpuinfo), the set
XLA's code generation, torch and NumPy each use and the switches that cap them (``machine``,
and the paragraph every report opens with, ``machine_markdown``), and ``emulation_gap``: why an
emulated older instruction set would measure torch at the wrong one."""

from __future__ import annotations

import datetime
import os
import platform

import jax
import numpy as np
import torch

from golden.bench.cells import _f

__all__ = ["XLA_ISAS", "ISA_FLAGS", "cpu_flags", "xla_max_isa", "xla_isa", "numpy_isas",
           "TORCH_CAPS", "emulation_gap", "machine", "machine_markdown"]


# XLA's names for x86 instruction sets (the values of --xla_cpu_max_isa), oldest first, each
# with the /proc/cpuinfo flag that says the host has it
XLA_ISAS = (("SSE4_2", "sse4_2"), ("AVX", "avx"), ("AVX2", "avx2"), ("AVX512", "avx512f"),
            ("AVX512_VNNI", "avx512_vnni"), ("AVX512_BF16", "avx512_bf16"), ("AMX", "amx_tile"))
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
             "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_int8", "asimd", "sve", "sve2")


def cpu_flags() -> set[str]:
    """The first processor's flags (x86 ``flags``, Arm ``Features``) in /proc/cpuinfo; empty
    where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.split(":")[0].strip() in
                         ("flags", "Features")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def xla_max_isa(xla_flags: str | None) -> str | None:
    """The value of --xla_cpu_max_isa in an XLA_FLAGS string (the last one wins), upper case;
    None if not set."""
    value = None
    for flag in (xla_flags or "").split():
        if flag.startswith("--xla_cpu_max_isa="):
            value = flag.split("=", 1)[1].upper()
    return value


def xla_isa(flags: set[str], max_isa: str | None) -> str | None:
    """The newest of XLA_ISAS that XLA's code generation may use: the host's newest (from its
    cpuinfo ``flags``) capped by --xla_cpu_max_isa; None off x86 or for a cap XLA_ISAS does not
    name (XLA_FLAGS, in the report too, then says what was asked)."""
    names = [name for name, _ in XLA_ISAS]
    have = [name for name, flag in XLA_ISAS if flag in flags]
    if not have:
        return None
    if max_isa is None:
        return have[-1]
    if max_isa not in names:
        return None
    return names[min(names.index(have[-1]), names.index(max_isa))]


def numpy_isas() -> tuple[list[str], list[str]]:
    """NumPy's (baseline, dispatched targets in use): the targets it was built for that this
    CPU has and NPY_DISABLE_CPU_FEATURES did not switch off, as np.show_runtime() lists them."""
    try:
        from numpy._core import _multiarray_umath as umath
    except ImportError:  # NumPy 1.x
        from numpy.core import _multiarray_umath as umath
    found = umath.__cpu_features__
    return list(umath.__cpu_baseline__), [t for t in umath.__cpu_dispatch__ if found.get(t)]


# What caps torch below the host's instruction set: ATen's vectorised kernels, MKL's BLAS (its
# float32 matmul, which torch's fused CPU attention calls) and oneDNN (its bfloat16 products).
# On an Intel Xeon with AMX (2026-11-26), ATEN_CPU_CAPABILITY=avx2 alone left the float32
# 2048² matmul at AVX-512 speed (62.8 ms; 130.7 ms with MKL_ENABLE_INSTRUCTIONS=AVX2) and made
# the bfloat16 fused kernel fail ("pack_vnni2 is only supported when avx512 is supported")
# until ONEDNN_MAX_CPU_ISA=AVX2 was set too (docs/performance.md).
TORCH_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def emulation_gap(flags: set[str], env) -> str | None:
    """Why an emulated run would measure torch at the wrong instruction set, or None: on a
    host with AVX-512 (cpuinfo ``flags``), ATEN_CPU_CAPABILITY set below it in ``env`` without
    MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA (TORCH_CAPS)."""
    aten = env.get("ATEN_CPU_CAPABILITY")
    if "avx512f" not in flags or aten is None or aten.lower().startswith("avx512"):
        return None
    missing = [name for name in TORCH_CAPS[1:] if not env.get(name)]
    if not missing:
        return None
    return (f"ATEN_CPU_CAPABILITY={aten} caps only ATen's own kernels on this AVX-512 CPU: "
            f"set {' and '.join(f'{name}=AVX2' for name in missing)} too (torch's matrix "
            f"products run in MKL and oneDNN; without them torch keeps its AVX-512 products, "
            f"and on a CPU with AMX its bfloat16 fused attention fails)")


def machine() -> dict:
    """The host and the instruction sets each library uses on it: the CPU's own (its cpuinfo
    flags, in XLA's names), XLA's code generation (capped by XLA_FLAGS=--xla_cpu_max_isa=...),
    torch's ATen kernels (torch.backends.cpu.get_cpu_capability(), capped by
    ATEN_CPU_CAPABILITY) and NumPy's dispatched loops (capped by NPY_DISABLE_CPU_FEATURES), with
    the environment variables as set."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags, xla_flags = cpu_flags(), os.environ.get("XLA_FLAGS")
    baseline, dispatched = numpy_isas()
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu_isa": xla_isa(flags, None), "cpu_flags": sorted(flags & set(ISA_FLAGS)),
            "xla_isa": xla_isa(flags, xla_max_isa(xla_flags)),
            "torch_isa": torch.backends.cpu.get_cpu_capability(),
            "numpy_isa": (dispatched or baseline or [None])[-1], "numpy_baseline": baseline,
            "numpy_dispatch": dispatched,
            "XLA_FLAGS": xla_flags, **{name: os.environ.get(name) for name in TORCH_CAPS},
            "NPY_DISABLE_CPU_FEATURES": os.environ.get("NPY_DISABLE_CPU_FEATURES"),
            "torch": torch.__version__, "jax": jax.__version__, "numpy": np.__version__,
            "python": platform.python_version(), "jax_backend": jax.default_backend(),
            "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def machine_markdown(m: dict) -> str:
    """One paragraph: the CPU, its instruction set and each library's, the switches set."""
    switches = "; ".join(f"{k}={m[k]}" for k in ("XLA_FLAGS", *TORCH_CAPS,
                                                   "NPY_DISABLE_CPU_FEATURES",
                                                   "OPENBLAS_CORETYPE") if m.get(k) is not None)
    return (f"Machine: {m['cpu']}, {m['cores']} cores (torch threads {m['torch_threads']}); "
            f"instruction set {_f(m['cpu_isa'], '{}')} (cpuinfo flags: "
            f"{' '.join(m['cpu_flags']) or '—'}); in use: XLA code generation "
            f"{_f(m['xla_isa'], '{}')}, torch {m['torch_isa']}, NumPy {_f(m['numpy_isa'], '{}')}; "
            f"{switches or 'no ISA switches set'}; torch {m['torch']}, jax {m['jax']} "
            f"({m['jax_backend']}), numpy {m['numpy']}, Python {m['python']}; {m['date']}.")
