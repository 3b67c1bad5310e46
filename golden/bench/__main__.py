"""``python -m golden.bench``: the same command as ``attn-parity bench`` (golden.bench.cli)."""

import sys

from golden.bench.cli import main

sys.exit(main())
