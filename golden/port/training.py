"""The same model trained in PyTorch (torch.optim) and in JAX (optax, ``nnx.Optimizer`` under
``nnx.jit``) stays the same: the optimizer pairings that are one algorithm, and the twin loops.

The model is our ``MultiHeadAttention`` (causal, dropout, biases) followed by a linear head,
loss the mean squared error against targets a causal model can learn (a fixed linear map of the
running mean of the inputs). Both frameworks start from the same neutral weights and see the
same batches and the same dropout masks, all drawn once with NumPy (``problem``).

Each entry of ``PAIRINGS`` is a torch optimizer (with its scheduler or gradient clipping) and an
optax transformation that compute the same updates; where a library default differs, its comment
and ``differs`` say which argument makes them equal, and ``naive`` holds the pairings of library
defaults (or plausible ports), which ``tests/test_training_parity.py`` measures apart.
In float64 the parameters agree to 1e-10 after 50 steps; float32 drifts by rounding:

    python -m golden.port.training [--steps N] [--plot docs/training_parity.png]

prints the float64 differences (defaults against the pairing) and the float32 drift per pairing,
and plots the float32 drift per step and both loss curves.

Shape legend: S steps, B batch, L sequence length, N heads, d_in input width, D model width
(d_out of the attention), C outputs of the head.
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import jax_attn
import torch_attn
from golden.specification.variants import VARIANTS
from jax_attn.functional import DEFAULT_PRECISION

VARIANT = "multi_head_attention"
CONFIG = dict(d_in=6, d_out=8, num_heads=2, causal=True, dropout=0.1, qkv_bias=True)
B, L, C = 4, 5, 3  # batch, sequence length, outputs of the head
STEPS = 50
LR_SGD = 0.03
LR_ADAM = 0.01
WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default; optax.adamw's is 1e-4
MAX_NORM = 1.0  # most steps clip here (30 to 50 of 50, seeds 0 to 7), some may not
START_LR, WARMUP = LR_ADAM / 10, 5  # the schedule: linear from START_LR to LR_ADAM in 5 steps,
END_LR = LR_ADAM / 100  # then cosine down to END_LR at step STEPS


# ---- the optimizer pairings -------------------------------------------------------------------

class TraceLikeTorchState(NamedTuple):
    count: jax.Array  # () int32: steps taken
    trace: optax.Params


def trace_like_torch(momentum: float, dampening: float) -> optax.GradientTransformation:
    """torch.optim.SGD's momentum buffer: b₁ = g₁ (undamped), then b = m·b + (1 − dampening)·g.
    ``optax.trace`` is this with dampening 0; optax has no dampening, and ``optax.ema`` damps the
    first step too (b₁ = (1 − m)·g₁)."""
    def init_fn(params):
        return TraceLikeTorchState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        trace = jax.tree.map(
            lambda g, b: jnp.where(state.count == 0, g, momentum * b + (1 - dampening) * g),
            updates, state.trace)
        return trace, TraceLikeTorchState(optax.safe_increment(state.count), trace)

    return optax.GradientTransformation(init_fn, update_fn)


def clip_by_global_norm_like_torch(max_norm: float) -> optax.GradientTransformation:
    """torch.nn.utils.clip_grad_norm_: every gradient times min(max_norm / (‖g‖ + 1e-6), 1),
    where ``optax.clip_by_global_norm`` multiplies by max_norm / ‖g‖ when ‖g‖ ≥ max_norm."""
    def update_fn(updates, state, params=None):
        del params
        coef = jnp.minimum(max_norm / (optax.tree.norm(updates) + 1e-6), 1.0)
        return jax.tree.map(lambda g: g * coef.astype(g.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


# The schedule both sides follow: optax's function, and torch's schedulers built to equal it.
SCHEDULE = optax.warmup_cosine_decay_schedule(init_value=START_LR, peak_value=LR_ADAM,
                                              warmup_steps=WARMUP, decay_steps=STEPS,
                                              end_value=END_LR)


def warmup_cosine_like_optax(optimizer):
    """``SCHEDULE`` in torch's own schedulers (the optimizer's lr is the peak, LR_ADAM).
    LinearLR's start_factor must be > 0: a warm-up from 0 needs LambdaLR(optimizer, lambda k:
    float(SCHEDULE(k)) / LR_ADAM), equal too when evaluated under x64 (else JAX's float32)."""
    sched = torch.optim.lr_scheduler
    return sched.SequentialLR(optimizer, [
        sched.LinearLR(optimizer, start_factor=START_LR / LR_ADAM, total_iters=WARMUP),
        sched.CosineAnnealingLR(optimizer, T_max=STEPS - WARMUP, eta_min=END_LR),
    ], milestones=[WARMUP])


@dataclass(frozen=True)
class Pairing:
    """A torch optimizer and an optax transformation that are one algorithm.

    ``torch`` makes the optimizer from the parameters; ``scheduler`` (optional) makes its
    learning-rate scheduler, stepped once after each ``optimizer.step()`` (before, when
    ``scheduler_first``: the off-by-one); ``clip`` is clip_grad_norm_'s max_norm, applied between
    ``backward`` and ``step``. ``masks``: "shared" dropout masks, or "drawn" by each framework.
    ``differs``: what differs by default and what makes them equal. ``naive``: the pairings of
    library defaults or plausible ports, each measured apart by the tests.
    """

    name: str
    torch: Callable
    optax: Callable[[], optax.GradientTransformation]
    differs: str = "nothing: the defaults are one algorithm"
    scheduler: Callable | None = None
    scheduler_first: bool = False
    clip: float | None = None
    masks: str = "shared"
    naive: tuple[Pairing, ...] = ()

    def but(self, differs, **changes) -> Pairing:
        """A naive twin: this pairing with ``changes``, described by ``differs``."""
        return replace(self, name=f"{self.name}: {differs}", differs=differs, naive=(), **changes)


def float_count(schedule):
    """``schedule`` of a float step count. optax passes its int32 count, and JAX divides int32
    in float32, so a warm-up (optax.linear_schedule), and join_schedules after it, gives float32
    rates even under x64; torch's rates are Python floats."""
    return lambda count: schedule(count.astype(float))


_SGD = torch.optim.SGD
PAIRINGS = [
    # SGD with momentum: torch's buffer starts at the first gradient (b₁ = g₁) and optax.trace
    # at zero (b₁ = 0·m + g₁): the same; torch's dampening defaults to 0, which is optax.trace.
    Pairing("sgd_momentum", lambda p: _SGD(p, lr=LR_SGD, momentum=0.9),
            lambda: optax.sgd(LR_SGD, momentum=0.9)),
    # Nesterov: both step along g + m·b with the new buffer b.
    Pairing("sgd_nesterov", lambda p: _SGD(p, lr=LR_SGD, momentum=0.9, nesterov=True),
            lambda: optax.sgd(LR_SGD, momentum=0.9, nesterov=True)),
    # Dampening τ: torch damps from the second step on (b₁ = g₁); optax.sgd has no dampening,
    # optax.ema damps the first step too: trace_like_torch(m, τ) is torch's buffer.
    Pairing("sgd_dampening", lambda p: _SGD(p, lr=LR_SGD, momentum=0.9, dampening=0.5),
            lambda: optax.chain(trace_like_torch(0.9, 0.5), optax.scale_by_learning_rate(LR_SGD)),
            differs="torch's dampening (default 0) has no optax argument: "
                    "chain(trace_like_torch(momentum, dampening), scale_by_learning_rate(lr))"),
    # Adam: both add eps outside the square root of the bias-corrected v̂, m̂ / (√v̂ + eps),
    # eps 1e-8; optax's eps_root (inside the root) must stay 0.
    Pairing("adam", lambda p: torch.optim.Adam(p, lr=LR_ADAM), lambda: optax.adam(LR_ADAM),
            differs="nothing: eps 1e-8 outside √v̂ in both (optax's eps_root must stay 0)"),
    # torch's Adam(weight_decay) is L2, coupled: wd·p joins the gradient before the moments.
    # optax: add_decayed_weights before adam; optax.adamw is the decoupled one.
    Pairing("adam_l2", lambda p: torch.optim.Adam(p, lr=LR_ADAM, weight_decay=WEIGHT_DECAY),
            lambda: optax.chain(optax.add_decayed_weights(WEIGHT_DECAY), optax.adam(LR_ADAM)),
            differs="torch's Adam(weight_decay) is coupled (L2 in the gradient): "
                    "chain(add_decayed_weights(wd), adam(lr)), not adamw"),
    # AdamW: both decoupled and both scale the decay by the learning rate (torch
    # p ← p·(1 − lr·wd), optax −lr·(û + wd·p)); the default weight decays differ.
    Pairing("adamw", lambda p: torch.optim.AdamW(p, lr=LR_ADAM),
            lambda: optax.adamw(LR_ADAM, weight_decay=WEIGHT_DECAY),
            differs="weight_decay: 0.01 in torch, 1e-4 in optax: optax.adamw(weight_decay=0.01)"),
    # Clipping by global norm: torch multiplies by max_norm / (‖g‖ + 1e-6) (capped at 1),
    # optax.clip_by_global_norm by max_norm / ‖g‖: clip_by_global_norm_like_torch.
    Pairing("clip", lambda p: _SGD(p, lr=LR_SGD, momentum=0.9),
            lambda: optax.chain(clip_by_global_norm_like_torch(MAX_NORM),
                                optax.sgd(LR_SGD, momentum=0.9)),
            clip=MAX_NORM,
            differs="clip_grad_norm_ divides by ‖g‖ + 1e-6, optax.clip_by_global_norm by ‖g‖: "
                    "clip_by_global_norm_like_torch(max_norm)"),
    # Warm-up then cosine, with AdamW: step k (from 0) takes SCHEDULE(k) on both sides when
    # torch's scheduler.step() follows optimizer.step() (optax counts the updates done); the
    # decoupled decay follows the scheduled rate on both sides.
    Pairing("schedule", lambda p: torch.optim.AdamW(p, lr=LR_ADAM, weight_decay=WEIGHT_DECAY),
            lambda: optax.adamw(float_count(SCHEDULE), weight_decay=WEIGHT_DECAY),
            scheduler=warmup_cosine_like_optax,
            differs="scheduler.step() after optimizer.step() is optax's count; in float64, "
                    "optax's warm-up rates are float32 unless the count is a float"),
    # Dropout: each framework draws its own masks (torch's global generator, the module's nnx
    # stream); the same dropout masks passed as dropout_mask make the runs equal.
    Pairing("dropout", lambda p: _SGD(p, lr=LR_SGD), lambda: optax.sgd(LR_SGD),
            differs="each framework draws its own masks: pass the same dropout_mask to both"),
]
_NAIVE = {
    "sgd_dampening": [("optax.sgd(momentum=0.9), no dampening",
                       dict(optax=lambda: optax.sgd(LR_SGD, momentum=0.9)))],
    "adam": [("optax.adam(eps=0, eps_root=1e-8): eps under the root",
              dict(optax=lambda: optax.adam(LR_ADAM, eps=0.0, eps_root=1e-8)))],
    "adam_l2": [("optax.adamw(weight_decay=0.01): decoupled",
                 dict(optax=lambda: optax.adamw(LR_ADAM, weight_decay=WEIGHT_DECAY)))],
    "adamw": [("optax.adamw's default weight_decay=1e-4",
               dict(optax=lambda: optax.adamw(LR_ADAM)))],
    "clip": [("optax.clip_by_global_norm(max_norm)",
              dict(optax=lambda: optax.chain(optax.clip_by_global_norm(MAX_NORM),
                                             optax.sgd(LR_SGD, momentum=0.9))))],
    "schedule": [("scheduler.step() before optimizer.step()", dict(scheduler_first=True)),
                 ("optax's int32 count: float32 rates",
                  dict(optax=lambda: optax.adamw(SCHEDULE, weight_decay=WEIGHT_DECAY)))],
    "dropout": [("masks drawn by each framework", dict(masks="drawn"))],
}
PAIRINGS = [replace(p, naive=tuple(p.but(d, **c) for d, c in _NAIVE.get(p.name, ())))
            for p in PAIRINGS]
BY_NAME = {p.name: p for p in PAIRINGS}
# The key bias moves no output: softmax is unchanged by the constant q·b_key that it adds to a
# query's every score. Its gradient is zero in exact arithmetic and rounding noise in each
# framework, which Adam divides by √v̂ + eps ≈ eps into steps of up to lr: its drift is reported
# apart from the parameters the loss depends on.
INERT = ("b_key",)


# ---- the problem ------------------------------------------------------------------------------

class Problem(NamedTuple):
    params: dict  # neutral float64 weights: the attention's, W_head (D, C) and b_head (C,)
    x: np.ndarray  # (S, B, L, d_in) float64
    y: np.ndarray  # (S, B, L, C) float64
    dropout_masks: np.ndarray  # (S, B, N, L, L) bool, True = kept (probability 1 − dropout)


def problem(seed: int = 0, steps: int = STEPS) -> Problem:
    """Initial weights, batches and dropout masks, drawn once with NumPy from ``seed``."""
    rng = np.random.default_rng(seed)
    shapes = {**VARIANTS[VARIANT].param_shapes(CONFIG), "W_head": (CONFIG["d_out"], C),
              "b_head": (C,)}
    params = {n: (rng.standard_normal(s) / np.sqrt(s[0]) if n.startswith("W")
                  else 0.1 * rng.standard_normal(s)) for n, s in shapes.items()}
    x = rng.standard_normal((steps, B, L, CONFIG["d_in"]))
    mean = np.cumsum(x, axis=-2) / np.arange(1, L + 1)[:, None]  # causal running mean
    y = mean @ rng.standard_normal((CONFIG["d_in"], C))  # (S, B, L, C)
    dropout_masks = rng.random((steps, B, CONFIG["num_heads"], L, L)) >= CONFIG["dropout"]
    return Problem(params, x, y, dropout_masks)


# ---- the twin loops ---------------------------------------------------------------------------

class TorchModel(torch.nn.Module):
    """The attention, then the head: x (B, L, d_in) -> (B, L, C); built from neutral params."""

    def __init__(self, params):
        super().__init__()
        self.attention = torch_attn.build(VARIANT, CONFIG, _attention(params))
        self.head = torch.nn.Linear(CONFIG["d_out"], C)
        self.head.weight.data = torch.tensor(params["W_head"].T)  # (C, D): torch's layout
        self.head.bias.data = torch.tensor(params["b_head"])

    def forward(self, x, dropout_mask=None):
        return self.head(self.attention(x, dropout_mask=dropout_mask))  # (B, L, C)

    def export(self) -> dict:
        return {**torch_attn.export_params(self.attention),
                "W_head": self.head.weight.detach().numpy().T.copy(),
                "b_head": self.head.bias.detach().numpy().copy()}


class JaxModel(nnx.Module):
    """The twin of ``TorchModel``; ``rngs`` seeds the attention's dropout stream."""

    def __init__(self, params, rngs):
        self.attention = jax_attn.build(VARIANT, CONFIG, _attention(params), rngs=rngs)
        dtype = params["W_head"].dtype
        self.head = nnx.Linear(CONFIG["d_out"], C, param_dtype=dtype, precision=DEFAULT_PRECISION,
                               rngs=nnx.Rngs(0))
        self.head.kernel.set_value(jnp.array(params["W_head"]))  # (D, C): the neutral layout
        self.head.bias.set_value(jnp.array(params["b_head"]))

    def __call__(self, x, dropout_mask=None):
        return self.head(self.attention(x, dropout_mask=dropout_mask))  # (B, L, C)

    def export(self) -> dict:
        return {**jax_attn.export_params(self.attention),
                "W_head": np.array(self.head.kernel.get_value()),
                "b_head": np.array(self.head.bias.get_value())}


def _attention(params) -> dict:
    return {n: a for n, a in params.items() if not n.endswith("_head")}


def train(pairing, framework: str, dtype: str = "float64", steps: int = STEPS,
          seed: int = 0) -> dict:
    """``steps`` steps of ``pairing`` (a Pairing or a name in ``BY_NAME``) in ``framework``
    ("torch" or "jax") at ``dtype``: {"params": [neutral params after each step], "loss":
    [the loss of each step's batch, before its update]}; torch's adds "grad_norm": [the norm
    clip_grad_norm_ saw at each step] when the pairing clips."""
    pairing = BY_NAME[pairing] if isinstance(pairing, str) else pairing
    data = problem(seed, steps)
    data = data._replace(params={n: a.astype(dtype) for n, a in data.params.items()},
                         x=data.x.astype(dtype), y=data.y.astype(dtype))
    if pairing.masks == "drawn":
        data = data._replace(dropout_masks=None)
    return {"torch": _train_torch, "jax": _train_jax}[framework](pairing, data, steps)


def _train_torch(pairing, data, steps) -> dict:
    with torch.random.fork_rng(devices=[]):  # the caller's generator state is left alone
        torch.manual_seed(0)  # the masks drawn when pairing.masks == "drawn"
        return _torch_loop(pairing, data, steps)


def _torch_loop(pairing, data, steps) -> dict:
    model = TorchModel(data.params).train()
    optimizer = pairing.torch(model.parameters())
    scheduler = pairing.scheduler and pairing.scheduler(optimizer)
    history = {"params": [], "loss": [], "grad_norm": []}
    for i in range(steps):
        dropout_mask = (None if data.dropout_masks is None
                        else torch.from_numpy(data.dropout_masks[i]))
        optimizer.zero_grad()
        out = model(torch.from_numpy(data.x[i]), dropout_mask=dropout_mask)
        loss = torch.mean((out - torch.from_numpy(data.y[i])) ** 2)
        loss.backward()
        if pairing.clip is not None:  # returns the norm before clipping
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), pairing.clip)
            history["grad_norm"].append(norm.item())
        if scheduler and pairing.scheduler_first:
            with warnings.catch_warnings():  # torch warns of the order: that is the point
                warnings.simplefilter("ignore", UserWarning)
                scheduler.step()
        optimizer.step()
        if scheduler and not pairing.scheduler_first:
            scheduler.step()
        history["loss"].append(loss.item())
        history["params"].append(model.export())
    return history


def _loss(model, x, y, dropout_mask):
    return jnp.mean((model(x, dropout_mask=dropout_mask) - y) ** 2)


@nnx.jit
def _jax_step(model, optimizer, x, y, dropout_mask):
    loss, grads = nnx.value_and_grad(_loss)(model, x, y, dropout_mask)
    optimizer.update(model, grads)
    return loss


def _train_jax(pairing, data, steps) -> dict:
    with jax.enable_x64(data.x.dtype == np.float64):
        model = JaxModel(data.params, nnx.Rngs(0))  # the stream draws when masks are "drawn"
        model.train()
        optimizer = nnx.Optimizer(model, pairing.optax(), wrt=nnx.Param)
        history = {"params": [], "loss": []}
        for i in range(steps):
            dropout_mask = (None if data.dropout_masks is None
                            else jnp.asarray(data.dropout_masks[i]))
            loss = _jax_step(model, optimizer, jnp.asarray(data.x[i]), jnp.asarray(data.y[i]),
                             dropout_mask)
            history["loss"].append(float(loss))
            history["params"].append(model.export())
        return history


def drift(a: dict, b: dict, names=None) -> np.ndarray:
    """(S,): max over parameters (``names``, default all but ``INERT``) of max |a − b| after
    each step, for two ``train`` results."""
    names = [n for n in a["params"][0] if n not in INERT] if names is None else names
    return np.array([max(float(np.max(np.abs(pa[n].astype(np.float64) - pb[n])))
                         for n in names) for pa, pb in zip(a["params"], b["params"])])


# ---- the report -------------------------------------------------------------------------------

def float64_rows(steps: int = STEPS, seed: int = 0) -> list[tuple[str, float, float]]:
    """(name, difference after ``steps`` float64 steps, that of the key bias) for every pairing
    and naive twin; the difference is max |p_torch − p_jax| over all parameters but ``INERT``."""
    rows = []
    for p in [q for p in PAIRINGS for q in (p, *p.naive)]:
        t, j = (train(p, f, "float64", steps, seed) for f in ("torch", "jax"))
        rows.append((p.name, drift(t, j)[-1], drift(t, j, INERT)[-1]))
    return rows


def float32_runs(steps: int = STEPS, seed: int = 0) -> dict:
    """{pairing: {"drift": (S,) (all but INERT), "key_bias": (S,), "torch", "jax": losses}}."""
    runs = {}
    for p in PAIRINGS:
        t, j = (train(p, f, "float32", steps, seed) for f in ("torch", "jax"))
        runs[p.name] = {"drift": drift(t, j), "key_bias": drift(t, j, INERT),
                        "torch": t["loss"], "jax": j["loss"]}
    return runs


def report(steps: int = STEPS, plot: str | None = None) -> dict:
    """Print the float64 table (every pairing and naive twin) and the float32 drift table; plot
    the float32 drift and losses to ``plot``. Returns ``float32_runs``."""
    print(f"float64, after {steps} steps: max |p_torch − p_jax| (all parameters but the key "
          "bias; the key bias apart)")
    print("| pairing | difference | key bias |\n| --- | --- | --- |")
    for name, d, key in float64_rows(steps):
        print(f"| {name} | {d:.1e} | {key:.1e} |")
    runs = float32_runs(steps)
    last = min(10, steps) - 1
    print(f"\nfloat32: drift max |p_torch − p_jax| after 1, {last + 1} and {steps} steps (all "
          "parameters but the key bias), the key bias's, and the final losses")
    print(f"| pairing | 1 | {last + 1} | {steps} | key bias | loss torch | loss jax |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        d = r["drift"]
        print(f"| {name} | {d[0]:.1e} | {d[last]:.1e} | {d[-1]:.1e} | {r['key_bias'][-1]:.1e} | "
              f"{r['torch'][-1]:.4f} | {r['jax'][-1]:.4f} |")
    if plot:
        _plot(runs, plot)
        print("\nwrote", plot)
    return runs


def _plot(runs, path, losses=("adamw", "schedule", "sgd_momentum")) -> None:
    """Left: the float32 drift per step of every pairing (log scale), and the key bias's under
    Adam; right: both loss curves (torch wide and pale, JAX dashed on top) of the ``losses``
    pairings."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="tight")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    for name, r in runs.items():
        left.plot(np.arange(1, len(r["drift"]) + 1), r["drift"], label=name)
    if "adam" in runs:
        key = runs["adam"]["key_bias"]
        left.plot(np.arange(1, len(key) + 1), key, color="black", linestyle=":",
                  label="adam: key bias (moves no output)")
    left.set(title="float32: max |p_torch − p_jax| after each step", xlabel="step",
             ylabel="max parameter difference", yscale="log")
    left.legend(fontsize=7, ncol=2)
    for name, colour in zip(losses, ("C0", "C1", "C2")):
        r = runs[name]
        steps = np.arange(1, len(r["torch"]) + 1)
        right.plot(steps, r["torch"], color=colour, linewidth=4, alpha=0.35,
                   label=f"{name} torch")
        right.plot(steps, r["jax"], color=colour, linewidth=1, linestyle="--",
                   label=f"{name} jax")
    right.set(title="float32: training loss", xlabel="step", ylabel="MSE", yscale="log")
    right.legend(fontsize=7)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m golden.port.training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--plot", metavar="PNG", help="write the float32 drift and loss plot")
    args = parser.parse_args(argv)
    report(args.steps, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
