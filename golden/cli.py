"""The ``attn-parity`` command: ``check``, ``compare``, ``hf``, ``fixtures``,
``regenerate [--check]``, ``bench``, ``device-check``.

User errors (a bad ``--impl``, a missing file) get a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from golden.runners import FRAMEWORKS
from golden.specification.tolerances import PROFILES
from golden.specification.validate import DTYPES
from golden.specification.recurrent import MIXERS
from golden.specification.variants import VARIANTS


def _fixture_selection(parser) -> None:
    """The options that choose fixtures, the same for ``check`` and ``fixtures``."""
    parser.add_argument("names", nargs="*", help="fixture names or paths (default: all shipped)")
    parser.add_argument("-k", dest="pattern", metavar="PATTERN",
                        help="fixtures whose name contains PATTERN (a glob if it has * ? [)")
    parser.add_argument("--variant", action="append", choices=[*VARIANTS, *MIXERS], default=[],
                        help="only fixtures of this variant (repeatable)")


def _check_parser(sub):
    check = sub.add_parser("check", help="run the fixtures through reference, torch, jax and "
                                         "any implementation (--impl)")
    _fixture_selection(check)
    check.add_argument("--framework", action="append", choices=FRAMEWORKS, default=[],
                       help="only this framework (repeatable; default: all installed, or none "
                            "when --impl is given)")
    check.add_argument("--impl", action="append", default=[], metavar="MODULE:CALLABLE",
                       help="also run this implementation: a runner (fixture, dtype) -> dict, "
                            "e.g. golden.runners.adapt.from_function(...); repeatable")
    check.add_argument("--dtype", action="append", choices=DTYPES, default=[],
                       help="only this dtype (repeatable; default: each fixture's own)")
    check.add_argument("--profile", choices=list(PROFILES), default="exact",
                       help="tolerances: exact (the table) or tf32/bf16 (float32 runs on such "
                            "matmul units: at most 2x a plain implementation's error)")
    check.add_argument("--hide-unsupported", action="store_true",
                       help="leave the not-supported rows out of the table (their reasons and "
                            "counts are printed after it either way)")
    check.add_argument("--json", metavar="FILE", help="write the report as JSON")
    check.add_argument("--junit", metavar="FILE", help="write the report as JUnit XML")
    check.add_argument("--html", metavar="DIR", help="write an HTML page with heatmaps")
    check.add_argument("--no-cache", action="store_true",
                       help="compile every JAX program afresh, without attn-parity's "
                            "persistent compilation cache (default: the cache in "
                            "$ATTN_PARITY_CACHE_DIR, else $XDG_CACHE_HOME/attn-parity/jax or "
                            "~/.cache/attn-parity/jax)")
    return check


def _fixtures_parser(sub):
    listing = sub.add_parser("fixtures", help="list the stored fixtures: variant, dtypes, "
                                              "configuration, input and parameter shapes")
    _fixture_selection(listing)
    listing.add_argument("--json", action="store_true", help="print JSON instead of text")
    return listing


def parser() -> argparse.ArgumentParser:
    """The command's parser (``bench`` takes its own options: golden.bench)."""
    parser = argparse.ArgumentParser(prog="attn-parity", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _check_parser(sub)
    _fixtures_parser(sub)
    compare = sub.add_parser("compare", help="compare your PyTorch module with your Flax NNX "
                                             "port (attn-parity compare --help)")
    from golden.compare import add_arguments

    add_arguments(compare)
    regen = sub.add_parser("regenerate",
                           help="rebuild the fixtures from golden/specification/cases.py")
    regen.add_argument("--check", action="store_true",
                       help="compare in memory with the files on disk; exit 1 on any difference")
    hf = sub.add_parser("hf", help="convert and check every attention layer of a local Hugging "
                                   "Face checkpoint (attn-parity hf --help)")
    from golden.verifier.check import add_arguments as hf_arguments

    hf_arguments(hf)
    sub.add_parser("bench", add_help=False,
                   help="time attention against the peers (attn-parity bench --help)")
    device = sub.add_parser("device-check", help="on a lent GPU: the JAX twin over every "
                                                 "fixture, the GPU tests and a bfloat16 timing "
                                                 "grid, into one folder (docs/devices.md)")
    from golden.device_check import add_arguments as device_arguments

    device_arguments(device)
    return parser


def main(argv=None) -> int:
    parser_ = parser()
    args, rest = parser_.parse_known_args(argv)
    if args.command == "bench":
        from golden.bench import main as bench_main

        return bench_main(rest)
    if rest:
        parser_.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "check":
        return _check(args, argv)
    if args.command == "fixtures":
        return _fixtures(args)
    if args.command == "hf":
        from golden.verifier.check import main as hf_main

        return hf_main(args)
    if args.command == "compare":
        from golden.compare import run_cli

        return run_cli(args, error_log=lambda line: print(line, file=sys.stderr))
    if args.command == "device-check":
        from golden.device_check.run import main as device_main

        return device_main(args, argv)
    from golden.harness.regenerate import regenerate

    return 1 if regenerate(check=args.check) and args.check else 0


def _check(args, argv) -> int:
    from golden import FixtureError
    from golden.harness.check import main as check_main
    from golden.runners import cache
    from golden.runners.adapt import load

    if args.impl and "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as ``python -m``: the user's modules import from here
    cached = (not args.no_cache and (args.impl or "jax" in (args.framework or FRAMEWORKS))
              and cache.enable())
    try:
        impls = [load(spec) for spec in args.impl]
        return check_main(args.names, frameworks=args.framework, impls=impls,
                          dtypes=args.dtype, pattern=args.pattern, variants=args.variant,
                          profile_name=args.profile, json_path=args.json,
                          junit_path=args.junit, html_dir=args.html,
                          hide_unsupported=args.hide_unsupported, background=True,
                          command=shlex.join(["attn-parity", *(sys.argv[1:] if argv is None
                                                               else argv)]))
    except (ValueError, OSError, FixtureError, ImportError) as e:  # OSError: a report's path
        print(f"attn-parity check: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    finally:
        if cached:
            cache.disable()  # a caller in this process (a test) compiles as before


def _fixtures(args) -> int:
    from golden import FixtureError
    from golden.harness.listing import main as listing_main

    try:
        return listing_main(args)
    except (ValueError, OSError, FixtureError) as e:  # a missing or corrupt file
        print(f"attn-parity fixtures: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
