"""Write transformers' gated delta-rule functions, verbatim, into a stand-in package for a
machine without transformers (the lent GPU's image has none and no internet):

    python bench/hf_excerpt.py DIR     # then PYTHONPATH=DIR on that machine

DIR/transformers/models/qwen3_next/modeling_qwen3_next.py then holds the installed
transformers' ``is_torchdynamo_exporting`` (from transformers.utils), ``l2norm``, ``torch_chunk_gated_delta_rule`` and
``torch_recurrent_gated_delta_rule``, their source text copied by ``inspect.getsource`` less
their decorators (the kernel hub's, which swaps in flash-linear-attention's kernel where it is
installed and otherwise runs this very source; nothing else rewritten), under the imports they
use, so that ``attn-parity bench --only linear`` times the
same peer there; the stand-in's ``__init__`` records the version it was copied from."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from transformers.utils import is_torchdynamo_exporting

FUNCTIONS = (is_torchdynamo_exporting, hf.l2norm, hf.torch_chunk_gated_delta_rule,
             hf.torch_recurrent_gated_delta_rule)


def _undecorated(source: str) -> str:
    lines = source.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("def "))
    return "".join(lines[start:])


def main(out: Path) -> None:
    package = out / "transformers"
    module = package / "models" / "qwen3_next" / "modeling_qwen3_next.py"
    module.parent.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        f'"""A stand-in: three functions of transformers {transformers.__version__}."""\n'
        f'__version__ = "{transformers.__version__}+excerpt"\n')
    for folder in (package / "models", module.parent):
        (folder / "__init__.py").write_text("")
    body = "\n\n".join(_undecorated(inspect.getsource(f)) for f in FUNCTIONS)
    module.write_text("import torch\nimport torch.nn.functional as F\n\n\n" + body)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
