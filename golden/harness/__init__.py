"""The harness: ``attn-parity check`` (``check``), the only writer of fixtures (``regenerate``)
and ``attn-parity fixtures`` (``listing``). Its other rooms are siblings at their public paths:
``golden.runners`` (a fixture through the reference, torch or JAX, each framework behind one
adapter, ``golden.runners.frameworks``) and ``golden.report`` (JSON, JUnit, HTML)."""
