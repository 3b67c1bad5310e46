"""The ``attn-parity`` command: ``check``, ``regenerate [--check]``, ``bench``."""

from __future__ import annotations

import argparse
import sys

from golden.runners import FRAMEWORKS

DTYPES = ("float32", "float64", "bfloat16", "float16")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="attn-parity", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run every fixture through reference, torch and jax")
    check.add_argument("names", nargs="*", help="fixture names (default: all shipped)")
    check.add_argument("-k", dest="pattern", metavar="PATTERN",
                       help="fixtures whose name contains PATTERN (a glob if it has * ? [)")
    check.add_argument("--framework", action="append", choices=FRAMEWORKS, default=[],
                       help="only this framework (repeatable; default: all installed)")
    check.add_argument("--dtype", action="append", choices=DTYPES, default=[],
                       help="only this dtype (repeatable; default: each fixture's own)")
    regen = sub.add_parser("regenerate", help="rebuild the fixtures from golden/cases.py")
    regen.add_argument("--check", action="store_true",
                       help="compare in memory with the files on disk; exit 1 on any difference")
    sub.add_parser("bench", add_help=False,
                   help="time attention against the peers (attn-parity bench --help)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from golden.bench import main as bench_main

        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "check":
        from golden.check import main as check_main

        return check_main(args.names, frameworks=args.framework, dtypes=args.dtype,
                          pattern=args.pattern)
    from golden.regenerate import regenerate

    return 1 if regenerate(check=args.check) and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
