"""``python -m golden [--check]``: regenerate the fixtures (same as ``attn-parity regenerate``)."""

import sys

from golden.cli import main

sys.exit(main(["regenerate", *sys.argv[1:]]))
