"""``attn-parity fixtures``: the stored fixtures and what each holds, without running anything.

One entry per fixture: its name, variant, dtypes, the configuration values that differ from the
variant's defaults (a required argument always shows), and the shapes of its inputs and
parameters (parameters in the neutral layout, y = x W + b). Fixtures are read with
``golden.load`` (validated, checked against the manifest when shipped, never unpickled).
"""

from __future__ import annotations

import json

import golden
from golden.specification.recurrent import MIXERS
from golden.specification.variants import REQUIRED, VARIANTS, lookup


def describe(fixture) -> dict:
    """A fixture's entry: {"name", "variant", "dtypes", "config", "inputs", "params"}, the
    shapes as lists, inputs and parameters in name order."""
    return {"name": fixture.name, "variant": fixture.variant, "dtypes": list(fixture.dtypes),
            "config": non_default(fixture.variant, fixture.config),
            "inputs": {n: list(fixture.inputs[n].shape) for n in sorted(fixture.inputs)},
            "params": {n: list(fixture.params[n].shape) for n in sorted(fixture.params)}}


def non_default(variant: str, config: dict) -> dict:
    """The entries of ``config`` a reader needs: required arguments and those that differ from
    the variant's default (a key the variant does not declare is kept as well)."""
    try:
        defaults = {a.name: a.default for a in lookup(variant).args}
    except ValueError:  # a variant this version does not know
        defaults = {}
    return {k: v for k, v in config.items()
            if k not in defaults or defaults[k] is REQUIRED or defaults[k] != v}


def entries(names=(), *, pattern=None, variants=()) -> list[dict]:
    """The entries of the fixtures named (shipped names or paths; default: every shipped one),
    filtered by ``pattern`` (a substring, or a glob with * ? [) and ``variants``."""
    from golden.harness.check import select

    if variants:
        known = [*VARIANTS, *MIXERS]  # the recurrent mixers' fixtures too
        unknown = [v for v in variants if v not in known]
        if unknown:
            raise ValueError(f"variants should be among {', '.join(known)}, got {unknown}")
    fixtures = [golden.load(n) for n in select(list(names or golden.names()), pattern)]
    return [describe(f) for f in fixtures if not variants or f.variant in variants]


def text(items: list[dict]) -> str:
    """Entries as text: a header line per fixture, then its config, inputs and parameters."""
    lines = []
    for e in items:
        config = ", ".join(f"{k}={v!r}" for k, v in e["config"].items()) or "(defaults)"
        lines += [f"{e['name']}  {e['variant']}  {', '.join(e['dtypes'])}",
                  f"  config: {config}",
                  f"  inputs: {_shapes(e['inputs'])}",
                  f"  params: {_shapes(e['params'])}"]
    lines.append(f"{len(items)} fixture{'' if len(items) == 1 else 's'}")
    return "\n".join(lines)


def _shapes(shapes: dict) -> str:
    return ", ".join(f"{n} {tuple(s)}" for n, s in shapes.items()) or "none"


def main(args, log=print) -> int:
    """0 when something was listed, 2 when nothing matched."""
    items = entries(args.names, pattern=args.pattern, variants=args.variant)
    if args.json:
        log(json.dumps(items, indent=1))
    else:
        log(text(items))
    return 0 if items else 2
