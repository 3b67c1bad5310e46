"""The checkpoint verifier, ``attn-parity hf DIR``: ``checkpoint`` (a checkpoint's safetensors
files, read without pickle), ``layout`` (where each family's attention layers sit), ``preflight``
(the whole checkpoint accounted for from its headers), ``exercise`` (inputs long enough for
windows, chunks and RoPE switches), ``model`` (the checkpoint's own Hugging Face module),
``check`` (the command: each layer an in-memory fixture checked by the twins and by HF's
module). It stands on the importer (``golden.hf``), the twins and the harness."""
