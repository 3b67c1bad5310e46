"""``attn-parity bench``: attention timed on CPU, the twins against each framework's own
attention and a plain one, and the modules as their users call them (``golden.bench.cli``'s
docstring says what a run measures and writes). One room a section, imports pointing down:

- ``cells``: how the tables write a number;
- ``grid``: the sizes of a run (``Shape``, ``Grid``, ``FULL``, ``QUICK``);
- ``timing``: timing a call (``measure``, ``measure_long``, ``steady_repeats``, ``other_cpu``);
- ``host``: the CPU, the instruction set each library uses, ``emulation_gap``;
- ``attention``: the attention grid, the matmul ceilings, its targets, grouped-query attention;
- ``modules``: module calls, KV-cache decoding, the decode step per option, MLA's decode step;
- ``long``, ``modern``, ``choice``: long sequences; sinks, chunks and ALiBi; the automatic
  choice;
- ``positions``: axial RoPE and MRoPE against 1-D RoPE in the twin modules (``--only``
  alone);
- ``linear``: the gated delta rule's chunked cores against transformers' functions, the
  decode step, peak memory (``--only`` alone);
- ``sparse``: a given selection, the cores' sparse implementation against dense causal
  attention, the crossover length, memory against L (``--only`` alone);
- ``report``: every section into one report (``run``) and its Markdown (``markdown``);
- ``cli``: the command (``main``; ``--only`` runs one of ``SECTIONS``).

Every public name of the rooms (each room's ``__all__``) is importable from ``golden.bench``
itself.
"""

# each room's public names (its __all__), the rooms in the order they import one another
from golden.bench.grid import *  # noqa: F403
from golden.bench.timing import *  # noqa: F403
from golden.bench.host import *  # noqa: F403
from golden.bench.attention import *  # noqa: F403
from golden.bench.modules import *  # noqa: F403
from golden.bench.long import *  # noqa: F403
from golden.bench.modern import *  # noqa: F403
from golden.bench.choice import *  # noqa: F403
from golden.bench.positions import *  # noqa: F403
from golden.bench.linear import *  # noqa: F403
from golden.bench.sparse import *  # noqa: F403
from golden.bench.report import *  # noqa: F403
from golden.bench.cli import *  # noqa: F403
