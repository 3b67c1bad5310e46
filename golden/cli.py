"""The ``attn-parity`` command: ``check``, ``regenerate [--check]``, ``bench``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]  # the repository root, when run from a checkout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="attn-parity", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run every fixture through reference, torch and jax")
    check.add_argument("names", nargs="*", help="fixture names (default: all shipped)")
    regen = sub.add_parser("regenerate", help="rebuild the fixtures from golden/cases.py")
    regen.add_argument("--check", action="store_true",
                       help="compare in memory with the files on disk; exit 1 on any difference")
    sub.add_parser("bench", add_help=False,
                   help="time attention against the peers (bench/attention.py; --help there)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "check":
        from golden.check import main as check_main

        return check_main(args.names)
    from golden.regenerate import regenerate

    return 1 if regenerate(check=args.check) and args.check else 0


def _bench(argv) -> int:
    """The benchmarks live in the source checkout's bench/ (they are not installed)."""
    if not (CHECKOUT / "bench" / "attention.py").exists():
        print(f"attn-parity bench: no bench/attention.py under {CHECKOUT}; run it from a source "
              "checkout installed with pip install -e", file=sys.stderr)
        return 2
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    from bench.attention import main as bench_main

    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
