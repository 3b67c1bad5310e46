"""Worked examples for ``attn-parity compare``, shipped so that docs/validating.md runs from an
installed package (which has no ``tests/``); the tests use the same modules.

Each module is a PyTorch module and its Flax NNX port, with the weight mapping between them and
a ``bug`` argument that plants a deliberate mistake for ``compare`` to find:

- ``golden.examples.port_pair``: a small causal-attention block with an MLP (torch, Flax);
- ``golden.examples.port_bugs``: a Qwen3-like block and the porting mistakes ``compare``
  locates between its submodules (torch, Flax);
- ``golden.examples.hf_ports``: Flax ports of transformers' ``GPT2Block`` and
  ``Qwen3Attention``, compared with the HF modules as they are (torch, Flax, transformers).

This package imports none of them: import the one you need.
"""
