"""What a described variant is: ``Arg`` (a constructor argument and its check), ``Input`` (an
array the variant is called with), ``Variant`` (the description every reader derives from) and
``check_param_shapes``. golden.specification.variants holds the attention variants' table built
from these, golden.specification.recurrent the recurrent token mixers'; both import this room.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from golden.specification.validate import FLOAT_DTYPES, dtype_name

REQUIRED = object()  # the default of an argument that has none


@dataclass(frozen=True)
class Arg:
    """A constructor argument: its name, its check (raises ValueError) and its default.
    ``pending``: the twins' constructors do not take it yet (the reference has it first): a
    configuration holds it only where given, and its readers take the default otherwise.
    Why not a plain default: config() fills every argument, the twins are built with the whole
    configuration as keywords (their constructors would refuse one they lack), and
    tests/test_modules.py compares the arguments with the twins' signatures; a fixture that
    gives one is skipped for the twins with the reason (tests/helpers.missing_option). For an
    option the reference has before the twins (GroupedQueryAttention's block indexer was, in
    issue 44); unmark it when the twins take it. No option is pending now."""

    name: str
    check: Callable[[str, object], None]
    default: object = REQUIRED
    pending: bool = False


@dataclass(frozen=True)
class Input:
    """An array the variant is called with, before ``mask``: its name, the configuration key of
    its feature width (None: any width), and whether it is on the query or the key side."""

    name: str
    width: str | None
    side: str = "query"  # "query" (length Lq) or "key" (length Lk)
    optional: bool = False


@dataclass(frozen=True)
class Variant:
    name: str                          # snake_case of the class name: fixtures, build, the CLI
    class_name: str | None             # None for the core function itself
    args: tuple[Arg, ...]              # constructor arguments in order (the core: its settings)
    shapes: Callable[[dict], dict]     # full configuration -> {parameter: shape}, neutral layout
    check_inputs: Callable             # (config, {name: array}, dropout rate) -> weights shape
    inputs: tuple[Input, ...] = (Input("x", "d_in"),)
    call_names: tuple[str, ...] = ()  # positional inputs of the core beyond inputs and mask
    dropout: bool = False              # the call takes ``dropout_mask=`` (training mode)
    layers: dict = field(default_factory=dict)  # role -> attribute path; "*" = one per head
    vectors: tuple = ()  # parameters the module holds as plain arrays, each under its own name
    sample: dict = field(default_factory=dict)  # small configuration for tests, sizes distinct

    @property
    def is_module(self) -> bool:
        return self.class_name is not None

    @property
    def positional(self) -> tuple[str, ...]:
        """The call's positional argument names, in order."""
        return tuple(i.name for i in self.inputs) + ("mask",) + self.call_names

    def config(self, given: dict) -> dict:
        """Check a configuration; return it complete, defaults filled in, in argument order."""
        known = {a.name for a in self.args}
        for name in given:
            if name not in known:
                raise ValueError(f"{name} is not an argument of {self.class_name or self.name}; "
                                 f"it takes {', '.join(a.name for a in self.args) or 'none'}")
        full = {}
        for a in self.args:
            if a.pending and a.name not in given:  # not yet the twins': left out, not filled
                continue
            if a.name not in given and a.default is REQUIRED:
                raise ValueError(f"{a.name} is required by {self.class_name or self.name}")
            full[a.name] = given.get(a.name, a.default)
            a.check(a.name, full[a.name])
        self.shapes(full)  # the checks across arguments (d_out divisible by num_heads)
        return full

    def param_shapes(self, config: dict) -> dict:
        """Check the configuration; return {parameter name: shape} in the neutral layout."""
        return self.shapes(self.config(config))

    def check_params(self, config: dict, params: dict) -> None:
        """Raise ValueError naming a missing, unexpected or wrongly shaped parameter."""
        want = self.param_shapes(config)
        check_param_shapes(want, params, f"{self.name} with config {config}")
        for name in want:
            if dtype_name(params[name].dtype) not in FLOAT_DTYPES:
                raise ValueError(f"parameter {name} dtype should be one of "
                                 f"{', '.join(FLOAT_DTYPES)}, got {dtype_name(params[name].dtype)}")

    def call_args(self, arrays: dict):
        """(positional arguments, keyword arguments) for calling the variant on named arrays."""
        args = [arrays.get(n) for n in self.positional]
        while args and args[-1] is None:
            args.pop()
        kwargs = {n: a for n, a in arrays.items() if n not in self.positional}
        return args, kwargs


def check_param_shapes(want: dict, params: dict, where: str) -> None:
    """Raise ValueError naming a parameter of ``params`` that is missing from, unexpected in
    (``where`` says for what) or shaped unlike ``want`` ({name: shape})."""
    for name in sorted(set(want) - set(params)):
        raise ValueError(f"parameter {name} is missing: expected shape {want[name]}; "
                         f"parameters should be {', '.join(sorted(want))}, got "
                         f"{', '.join(sorted(params)) or 'none'}")
    for name in sorted(set(params) - set(want)):
        raise ValueError(f"parameters should be exactly {', '.join(sorted(want))} for {where}, "
                         f"got an unexpected {name}")
    for name, shape in want.items():
        got = tuple(np.shape(params[name]))
        if got != tuple(shape):
            raise ValueError(f"parameter {name} shape should be {tuple(shape)}, got {got}")
