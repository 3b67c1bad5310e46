"""Named implementations of the core: the contract both twins' registries follow, and the record
of which implementation ran (framework-free: the spec layer).

Each twin keeps an explicit registry (``torch_attn.IMPLEMENTATIONS``,
``jax_attn.IMPLEMENTATIONS``): a name, the function that runs it (one signature per twin,
returning ``(output, weights | None)``), and ``refuses(asked)``, the reason it cannot honour a
call's arguments (None when it can). ``implementation=name`` runs that implementation or raises
the ValueError with its reason: never a silent fallback. ``implementation=None`` takes the first
implementation of the twin's preference order (its ``choose``, written once) that does not
refuse. A name means one algorithm in both twins; the names in use:

    explicit     the (Lq, Lk) weights formed, softmax, then the weighted sum of values
    fused        PyTorch's scaled_dot_product_attention kernel (torch only)
    row_chunks   the explicit path by chunks of query rows, the backward recomputing each
                 chunk's weights (torch only: O(rows · Lk) memory)
    sparse       the keys each query row chose (key_indices) gathered, a softmax over those k
                 alone, by blocks of query rows, each recomputed in the backward: O(Lq·k)
                 work and memory, never an (Lq, Lk) array
    blockwise    FlashAttention-2: an online softmax over key blocks and a backward of its own
                 from the saved log-sum-exp (JAX only: O(L) memory)
    cudnn        cuDNN's fused flash attention through jax.nn.dot_product_attention
                 (JAX only, NVIDIA GPUs, float16 and bfloat16)
    pallas       the Pallas flash-attention kernel (jax.experimental.pallas.ops.gpu.attention;
                 JAX only: compiled on an NVIDIA GPU, Pallas's interpret mode on a CPU)
    splash       the TPU splash-attention kernel (jax.experimental.pallas.ops.tpu.
                 splash_attention; JAX only: compiled on a TPU, Pallas's interpret mode
                 elsewhere)

``record()`` collects, in the running thread, the (framework, name) of every core call that runs
inside it: the harness reads which implementation ran instead of working it out again.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import NamedTuple


class Asked(NamedTuple):
    """What a call asks of an implementation beyond the arrays themselves. Every field has a
    default that asks nothing, so a twin fills in only what its implementations look at (the
    fields from ``platform`` on are read by JAX's accelerator kernels, "cudnn", "pallas" and
    "splash", which take a narrower set of calls than the portable implementations)."""

    return_weights: bool = False
    softcap: bool = False
    dropout: bool = False
    gradients: bool = False
    block_sizes: object = None  # as the caller gave it (None: not given)
    sinks: bool = False
    key_indices: bool = False  # a selection given (the keys each query row may choose from)
    platform: str = ""  # the backend the call runs on ("cpu", "gpu", "tpu"; "" unknown)
    dtype: str = ""  # the query's dtype name ("" unknown)
    lengths: tuple = ()  # (Lq, Lk), () unknown
    widths: tuple = ()  # (Dk, Dv), () unknown
    heads: tuple = ()  # (H, Hkv), () unknown
    mask: bool = False
    bias: bool = False
    causal: bool = False
    window: tuple = (None, None)  # (left, right) as golden.specification.validate.window gives it
    seq_lengths: bool = False  # query_seq_lengths or key_value_seq_lengths given
    offset: bool = False  # query_offset given
    chunk: bool = False  # attention_chunk_size given
    distance_bias: bool = False
    distance_keys: bool = False  # distance_query and distance_keys given (JAX)
    sharded: bool = False  # on a mesh with explicit axes


class Implementation(NamedTuple):
    """One named implementation: ``run`` computes, ``refuses(asked)`` says why it cannot.
    ``whole``: ``run`` takes the whole (B, H, L, D) call rather than one head (the twin then
    calls it as it is, without mapping it over heads; JAX's accelerator kernels). ``grouped``:
    ``run`` takes one kv head's G query heads at once, every per-head argument with a leading
    G|1 axis (JAX's "sparse": one gather of the chosen keys for the G heads)."""

    name: str
    run: Callable
    refuses: Callable[[Asked], str | None]
    whole: bool = False
    grouped: bool = False


class Registry:
    """A twin's implementations by name. ``select`` is the one place a call's implementation is
    decided, given the twin's order of preference for ``implementation=None``."""

    def __init__(self, framework: str, *implementations: Implementation):
        self.framework = framework
        self._by_name = {i.name: i for i in implementations}

    def __getitem__(self, name) -> Implementation:
        return self._by_name[name]

    @property
    def names(self) -> tuple[str, ...]:
        """Every implementation's name, in the order registered."""
        return tuple(self._by_name)

    def refuses(self, name: str, asked: Asked) -> str | None:
        """Why implementation ``name`` cannot honour ``asked`` (None: it can)."""
        return self.named(name).refuses(asked)

    def named(self, name) -> Implementation:
        """The implementation called ``name``; ValueError listing the names otherwise."""
        if not isinstance(name, str) or name not in self._by_name:
            names = ", ".join(repr(n) for n in self._by_name)
            hint = (" ('dense' is now 'explicit', the weights formed)"
                    if name == "dense" else "")
            raise ValueError(f"implementation should be None or one of {names} "
                             f"({self.framework}), got {name!r}{hint}")
        return self._by_name[name]

    def select(self, name, asked: Asked, preference) -> Implementation:
        """The implementation a call runs: ``name``, or when None the first of ``preference``
        that does not refuse; ValueError with the reason when it (or every one) refuses."""
        if name is not None:
            implementation = self.named(name)
            reason = implementation.refuses(asked)
            if reason:
                raise ValueError(f"implementation={name!r} cannot run this call: {reason}")
            ran(self.framework, name)
            return implementation
        reasons = []
        for candidate in preference:
            reason = self._by_name[candidate].refuses(asked)
            if reason is None:
                ran(self.framework, candidate)
                return self._by_name[candidate]
            reasons.append(f"{candidate}: {reason}")
        raise ValueError("no implementation can run this call (" + "; ".join(reasons) + ")")


_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar("ran", default=None)


@contextlib.contextmanager
def record():
    """A list that collects (framework, implementation name) for every core call inside the
    block. Under a framework's own tracing (``jax.jit`` around the call, or a JAX module's
    compiled ``__call__``) a call is recorded when it is traced, not each time the compiled
    program runs again: a caller that needs the name on every call keeps the first one per
    program (as golden.runners.jax_runner does)."""
    ran_here: list = []
    token = _RECORD.set(ran_here)
    try:
        yield ran_here
    finally:
        _RECORD.reset(token)


def ran(framework: str, name: str) -> None:
    """Note that ``framework``'s core ran implementation ``name`` (inside ``record()``)."""
    ran_here = _RECORD.get()
    if ran_here is not None:
        ran_here.append((framework, name))


def ran_instead(framework: str, name: str, instead: str) -> None:
    """Note that ``framework``'s core ran ``name`` where ``instead`` was noted: the last
    (framework, instead) in the ``record()`` list becomes (framework, name), or it is appended
    (a differentiated call whose forward is not the one its undifferentiated call runs)."""
    ran_here = _RECORD.get()
    if ran_here is None:
        return
    for i in range(len(ran_here) - 1, -1, -1):
        if ran_here[i] == (framework, instead):
            ran_here[i] = (framework, name)
            return
    ran_here.append((framework, name))


def names(ran: list) -> str:
    """The names in a ``record()`` list, each once, in the order they first ran ("explicit",
    "explicit, fused"); "" when none ran."""
    return ", ".join(dict.fromkeys(name for _, name in ran))
