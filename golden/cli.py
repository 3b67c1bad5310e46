"""The ``attn-parity`` command: ``check``, ``regenerate [--check]``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="attn-parity", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run every fixture through reference, torch and jax")
    check.add_argument("names", nargs="*", help="fixture names (default: all shipped)")
    regen = sub.add_parser("regenerate", help="rebuild the fixtures from golden/cases.py")
    regen.add_argument("--check", action="store_true",
                       help="compare in memory with the files on disk; exit 1 on any difference")
    args = parser.parse_args(argv)
    if args.command == "check":
        from golden.check import main as check_main

        return check_main(args.names)
    from golden.regenerate import regenerate

    return 1 if regenerate(check=args.check) and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
