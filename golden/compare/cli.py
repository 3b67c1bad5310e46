"""The ``attn-parity compare`` sub-command: its options, the checks of how they combine, and
the run (compare or check a port fixture, freeze, write the JSON report, print the table).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from golden.specification import mapping as mapping_lib
from golden.compare.calls import RUN_DTYPES
from golden.compare.checks import check_port, compare
from golden.compare.port_fixture import freeze
from golden.compare.report import SCHEMA, PortReport
from golden.specification.fixture import write_atomic
from golden.runners.adapt import SPEC, resolve_spec


def add_arguments(parser) -> None:
    """The ``compare`` sub-command's options."""
    parser.add_argument("--torch", metavar="SPEC", help="torch module factory, pkg.mod:callable")
    parser.add_argument("--flax", metavar="SPEC", help="Flax NNX module factory, pkg.mod:callable")
    parser.add_argument("--mapping", metavar="SPEC_OR_FILE",
                        help="a JSON file {torch key: [flax path, rule]}, or pkg.mod:NAME of such "
                             "a dict")
    parser.add_argument("--input", metavar="NAME=D1,D2,...", action="append", default=[],
                        help="an input and its shape, in call order (repeatable)")
    parser.add_argument("--keywords", metavar="SPEC",
                        help="pkg.mod:NAME of a dict {name: value} passed to both modules by name "
                             "(shapes, arrays, nested arrays, plain values, factories: the "
                             "keywords= of golden.compare.compare)")
    parser.add_argument("--keyword-grad", metavar="NAME", action="append", default=[],
                        help="a keyword whose gradient is compared too (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn weights and inputs")
    parser.add_argument("--dtype", choices=RUN_DTYPES, default="float32",
                        help="run the Flax module and the torch baseline in this dtype (torch "
                             "float64 stays the reference; default float32)")
    parser.add_argument("--output", metavar="INDEX_OR_NAME",
                        help="the array to judge in what the modules return: an index or a name "
                             "(key or field); default the output, or its first array")
    parser.add_argument("--freeze", metavar="FILE", help="write what was drawn as a port fixture")
    parser.add_argument("--fixture", metavar="FILE",
                        help="check the Flax module against a frozen port fixture instead")
    parser.add_argument("--no-torch", action="store_true",
                        help="with --fixture: leave out the torch float32 baseline column, so "
                             "that torch is neither imported nor needed")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")


def run_cli(args, log=print, error_log=None) -> int:
    """0 when the port passes, 1 when it fails, 2 on a usage error (one line, no traceback,
    through ``error_log``, default ``log``; the command sends it to stderr).
    The current directory is importable, so specs may name the user's own modules."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        report = _cli_report(args)
        if args.freeze:
            freeze(report, args.freeze, torch_factory_spec=args.torch,
                   flax_factory_spec=args.flax)
        if args.json:
            text = json.dumps({**SCHEMA, **report.to_json()}, indent=1, allow_nan=False)
            write_atomic(Path(args.json), (text + "\n").encode("utf-8"))
    except (ValueError, OSError) as e:  # FixtureError included
        (error_log or log)(f"attn-parity compare: error: {str(e).splitlines()[0]}")
        return 2
    log(report.text())
    if args.freeze:
        log(f"froze the port fixture {args.freeze}")
    return 0 if report.ok else 1


def _cli_report(args) -> PortReport:
    no_torch = getattr(args, "no_torch", False)
    if no_torch and not args.fixture:
        raise ValueError("--no-torch goes with --fixture FILE (compare without a fixture runs "
                         "torch float64 as the reference)")
    if no_torch and args.torch:
        raise ValueError(f"--no-torch leaves torch out, got --torch {args.torch!r} as well")
    if args.fixture:
        given = [o for o, v in (("--dtype", args.dtype != "float32"), ("--output", args.output),
                                ("--keywords", getattr(args, "keywords", None)),
                                ("--keyword-grad", getattr(args, "keyword_grad", None)))
                 if v]
        if given:
            raise ValueError(f"{', '.join(given)}: a port fixture records its own; leave them "
                             f"out with --fixture")
        return check_port(args.fixture, args.flax and resolve_spec(args.flax),
                          False if no_torch else args.torch and resolve_spec(args.torch))
    absent = [o for o, v in (("--torch", args.torch), ("--flax", args.flax),
                             ("--mapping", args.mapping), ("--input", args.input)) if not v]
    if absent:
        raise ValueError(f"compare needs {', '.join(absent)} (or --fixture FILE)")
    output = args.output
    if output is not None and output.lstrip("-").isdigit():
        output = int(output)
    return compare(_factory(args.torch), _factory(args.flax), _cli_mapping(args.mapping),
                   _cli_inputs(args.input), seed=args.seed, dtype=args.dtype, output=output,
                   keywords=_cli_keywords(getattr(args, "keywords", None)),
                   keyword_grads=tuple(getattr(args, "keyword_grad", None) or ()))


def _cli_keywords(spec):
    """The dict named by ``--keywords pkg.mod:NAME`` (None when not given)."""
    if spec is None:
        return None
    table = resolve_spec(spec)
    if not isinstance(table, dict):
        raise ValueError(f"--keywords {spec!r} should name a dict {{name: value}}, got "
                         f"{type(table).__name__}")
    return table


def _factory(spec):
    obj = resolve_spec(spec)
    if not callable(obj):
        raise ValueError(f"spec {spec!r} should name a callable, got {type(obj).__name__}")
    return obj


def _cli_mapping(value):
    """A JSON file's path, or a "pkg.mod:NAME" naming a dict."""
    if Path(value).exists() or not SPEC.match(value):
        return mapping_lib.parse(value)
    table = resolve_spec(value)
    if not isinstance(table, dict):
        raise ValueError(f"--mapping {value!r} should name a dict, got {type(table).__name__}")
    return table


def _cli_inputs(items) -> dict:
    """{name: shape} from ["x=2,5,8", ...], in order."""
    out = {}
    for item in items:
        name, _, dims = item.partition("=")
        try:
            shape = tuple(int(d) for d in dims.split(","))
        except ValueError:
            shape = ()
        if not name.isidentifier() or not shape or min(shape) <= 0 or name in out:
            raise ValueError(f"--input should be NAME=D1,D2,... with positive sizes and a new "
                             f"name, got {item!r}")
        out[name] = shape
    return out
