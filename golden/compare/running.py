"""Running the two frameworks for ``golden.compare``: the user's torch module and their Flax
NNX port on the same weights and inputs.

``_run_torch`` copies the module into a dtype, sets the weights, and records the output, the
gradients of L = Σ output ⊙ dO and the paired submodules' first inputs and outputs (hooks);
``_run_flax`` sets every ``nnx.Param`` through the mapping's rule and gets the same from one
``nnx.jit`` program (``nnx.capture``, and a patched ``__call__`` that sows each paired
submodule's input), the gradients mapped back to the torch layout.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import numpy as np

from golden.compare.calls import _PLAIN_CALL, _Call, _first_array
from golden.runners.frameworks import JAX, TORCH


def _run_torch(module, dtype: str, weights: dict, inputs: dict, pairs: list, cotangent,
               call: _Call = _PLAIN_CALL) -> dict:
    """Output, gradients (parameters, float inputs and the keywords ``call`` differentiates)
    and first-call outputs of the paired torch submodules, in the order they ran.
    ``cotangent`` is dO, or a function of the output shape that draws it (returned as
    "cotangent")."""
    import torch

    module = copy.deepcopy(module).to(TORCH.dtype(dtype)).eval()
    with torch.no_grad():
        for k, p in module.named_parameters():
            p.copy_(TORCH.array(weights[k]))
            p.requires_grad_(True)  # a frozen parameter is compared like the others
    args = list(TORCH.leaves(inputs, dtype).values())
    kwargs = call.kwargs("torch", dtype)
    for n in call.grads:
        kwargs[n].requires_grad_(True)
    captured, captured_in, hooks = {}, {}, []
    for path in dict.fromkeys(t for t, _ in pairs):
        def hook(_m, _in, out, path=path):
            captured.setdefault(path, TORCH.numpy(_first_array(out, sort_keys=True)))

        def pre_hook(_m, args, kwargs, path=path):  # the first call's first array argument
            if path not in captured_in:
                first = _first_tensor(torch, (*args, *kwargs.values()))
                captured_in[path] = TORCH.numpy(first) if first is not None else None
        sub = module.get_submodule(path)
        hooks += [sub.register_forward_pre_hook(pre_hook, with_kwargs=True),
                  sub.register_forward_hook(hook)]
    try:
        out = call.select(_call("torch", module, args, inputs, kwargs), "torch")
    finally:
        for h in hooks:
            h.remove()
    d_out = cotangent(tuple(out.shape)) if callable(cotangent) else cotangent
    (out * TORCH.array(d_out, dtype)).sum().backward()
    grads = {k: TORCH.numpy(p.grad) if p.grad is not None else np.zeros(p.shape)
             for k, p in module.named_parameters()}
    grads.update({f"input.{n}": TORCH.numpy(a.grad) for n, a in zip(inputs, args)
                  if a.requires_grad})
    grads.update({f"input.{n}": TORCH.numpy(kwargs[n].grad) if kwargs[n].grad is not None
                  else np.zeros(kwargs[n].shape) for n in call.grads})
    return {"output": TORCH.numpy(out), "grads": grads, "submodules": captured,
            "submodule_inputs": {p: a for p, a in captured_in.items() if a is not None},
            "cotangent": d_out}


def _first_tensor(torch, values):
    """The first floating-point tensor among ``values`` that comes before any other array (an
    integer or boolean first array, token ids or a mask, is not compared: None)."""
    first = next((v for v in values if isinstance(v, torch.Tensor)), None)
    return first if first is not None and first.is_floating_point() else None


def _call(framework, module, args, inputs, kwargs=None):
    """module(*args, **kwargs), a failure turned into a ValueError naming the inputs' shapes."""
    try:
        return module(*args, **(kwargs or {}))
    except ValueError as e:
        if str(e).startswith("output:"):  # the output selection's own message
            raise
        return _failed(framework, e, inputs)
    except Exception as e:
        return _failed(framework, e, inputs)


def _failed(framework, e, inputs):
    shapes = {n: tuple(a.shape) for n, a in inputs.items()}
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise ValueError(f"inputs: the {framework} module failed on inputs {shapes}: "
                     f"{type(e).__name__}: {first}") from e


def _built(factory, framework):
    """factory(), checked to be a torch.nn.Module or an nnx.Module."""
    if framework == "torch":
        from torch.nn import Module
    else:
        from flax.nnx import Module
    model = factory()
    if not isinstance(model, Module):
        kind = "torch.nn.Module" if framework == "torch" else "flax.nnx.Module"
        raise ValueError(f"{framework}_factory should return a {kind}, got "
                         f"{type(model).__name__}")
    return model


def _flax_shapes(model) -> dict:
    from flax import nnx

    return {_join(p): tuple(v.get_value().shape)
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _join(path) -> str:
    return ".".join(str(p) for p in path)


def _set_flax_params(model, table, weights, dtype="float32") -> None:
    """Every nnx.Param set to its torch weight through the rule, in ``dtype``."""
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    source = {path: (key, rule) for key, (path, rule) in table.items()}
    for p, var in nnx.to_flat_state(state):
        key, rule = source[_join(p)]
        var.set_value(JAX.array(rule.apply(weights[key]), dtype))
    nnx.update(model, state)


_CALL_INPUT = "__call_input__"  # the name a paired Flax submodule's call input is sown under


@contextlib.contextmanager
def _sowing_call_inputs(modules):
    """While open, each module's class's ``__call__`` sows its first array argument (when it
    is a float array) as an ``nnx.Intermediate`` named ``_CALL_INPUT``, next to the output
    ``nnx.capture(..., method_outputs=...)`` sows (which records outputs only, flax 0.12).
    The class is patched, as ``nnx.capture`` patches it, since Python looks ``__call__`` up on
    the type; the original is put back on leaving."""
    patched = {}
    for m in modules:
        cls = next(c for c in type(m).__mro__ if "__call__" in c.__dict__)
        if cls not in patched:
            patched[cls] = cls.__dict__["__call__"]
            cls.__call__ = _sowing_input(patched[cls])
    try:
        yield
    finally:
        for cls, method in patched.items():
            cls.__call__ = method


def _sowing_input(method):
    """``method`` (a ``__call__``) that first sows its first array argument, if float."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, jax.Array)), None)
        if (first is not None and jnp.issubdtype(first.dtype, jnp.floating)
                and hasattr(self, "__captures__")):  # only inside nnx.capture
            self.sow(nnx.Intermediate, _CALL_INPUT, first)
        return method(self, *args, **kwargs)

    return wrapper


def _run_flax(model, table, weights: dict, inputs: dict, d_out, pairs=(),
              call: _Call = _PLAIN_CALL, dtype: str = "float32") -> dict:
    """Output, gradients in torch names and layout, and every submodule's first __call__
    output and, for the paired ones, its first call's first array argument, from one nnx.jit
    program in ``dtype``. Keyword inputs are closed over (constants of the program), but for
    the differentiated ones, which are arguments."""
    import jax.numpy as jnp
    from flax import nnx

    _set_flax_params(model, table, weights, dtype)
    model.eval()
    arrays = JAX.leaves(inputs, dtype)
    kwargs = call.kwargs("flax", dtype)
    floats = {n: a for n, a in arrays.items() if jnp.issubdtype(a.dtype, jnp.floating)}
    floats.update({n: kwargs.pop(n) for n in call.grads})
    others = {n: a for n, a in arrays.items() if n not in floats}

    paired = {f for _, f in pairs}

    @nnx.jit
    def step(model, floats, others, d_out):
        def loss(model, floats):
            args = [{**others, **floats}[n] for n in arrays]
            given = {**kwargs, **{n: floats[n] for n in call.grads}}
            subs = [m for p, m in nnx.iter_modules(model) if _join(p) in paired]
            with _sowing_call_inputs(subs):
                out, inter = nnx.capture(model, nnx.Intermediate,
                                         method_outputs=nnx.Intermediate)(*args, **given)
            out = call.select(out, "flax")
            return jnp.sum(out * d_out), (out, inter)

        argnums = (nnx.DiffState(0, nnx.Param), 1)
        (_, (out, inter)), (g_model, g_in) = nnx.value_and_grad(
            loss, argnums=argnums, has_aux=True)(model, floats)
        return out, g_model, g_in, inter

    out, g_model, g_in, inter = _call("Flax", step, (model, floats, others,
                                                     JAX.array(d_out, dtype)), inputs)
    g_flax = {_join(p): JAX.numpy(v.get_value()) for p, v in nnx.to_flat_state(g_model)}
    grads = {k: rule.inverse(g_flax[path], weights[k].shape) for k, (path, rule) in table.items()}
    grads.update({f"input.{n}": JAX.numpy(g) for n, g in g_in.items()})
    sown = {name: {_join(p[:-1]): JAX.numpy(_first_array(v.get_value()[0], sort_keys=True))
                   for p, v in nnx.to_flat_state(inter) if p[-1] == name and len(p) > 1}
            for name in ("__call__", _CALL_INPUT)}
    return {"output": JAX.numpy(out), "grads": grads, "submodules": sown["__call__"],
            "submodule_inputs": sown[_CALL_INPUT]}
