"""How long ``attn-parity hf`` takes on checkpoints of real models' attention shapes.

    python bench/hf_time.py [--dir DIR] [--layers K] [--only NAME ...]

Writes (once, into DIR, default /tmp/attn-parity-hf-bench) random-weight checkpoints made
offline with transformers' ``save_pretrained``, each of a real model's attention shapes (its
vocabulary cut to 1,024 tokens and its MoE experts to a few, which the command never reads):
Llama-3.2-1B (bfloat16, llama3 RoPE), Qwen3-0.6B (bfloat16), Gemma-3-1B's text model (bfloat16,
22 of 26 layers sliding with a 512-key window: inputs of 515 tokens), a small DeepSeek-V3 (MLA)
and Whisper-small (float32, encoder, decoder and cross-attention). Then, per checkpoint, times
the whole command as a process (JAX's compilation cache off, so each run compiles):
``--layers 0:1`` and ``--layers 0:K`` (K = 8; of each stack); the difference over the layers
added is the time per layer once the programs are compiled, and the first is the start-up, the
accounting, the first layer (of each stack) and its compilation. Each run is timed twice and
the faster kept. Also times a damaged copy (config.json declaring one layer more than the weights
hold), refused with exit status 2 before anything is computed. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    "llama-3.2-1b": ("LlamaConfig", "bfloat16", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})),
    "qwen3-0.6b": ("Qwen3Config", "bfloat16", dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "gemma-3-1b": ("Gemma3TextConfig", "bfloat16", dict(
        hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, intermediate_size=6912, sliding_window=512, query_pre_attn_scalar=256,
        max_position_embeddings=32768,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
    "deepseek-v3-small": ("DeepseekV3Config", "bfloat16", dict(
        hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, intermediate_size=2048, moe_intermediate_size=256, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=4, max_position_embeddings=4096)),
    "whisper-small": ("WhisperConfig", "float32", dict(
        d_model=768, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12,
        decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
        num_mel_bins=80, max_source_positions=1500, max_target_positions=448, pad_token_id=1,
        bos_token_id=2, eos_token_id=2, decoder_start_token_id=3)),
}


def make(name, directory) -> Path:
    """The checkpoint of ``name``'s shapes, written once."""
    import torch
    import transformers

    path = directory / name
    if (path / "config.json").exists():
        return path
    config_class, dtype, kw = SHAPES[name]
    config = getattr(transformers, config_class)(vocab_size=1024, **kw)
    cls = (transformers.WhisperForConditionalGeneration if name.startswith("whisper")
           else transformers.AutoModelForCausalLM)
    torch.manual_seed(0)
    model = (cls._from_config(config, dtype=getattr(torch, dtype)) if hasattr(cls, "_from_config")
             else cls.from_config(config, dtype=getattr(torch, dtype)))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() == 2 else 0.5)
    model.save_pretrained(path)
    return path


REPEATS = 2  # each run timed this many times, the fastest kept (this host's noise: ±30 %)


def timed(argv) -> tuple[float, int, str]:
    best, status, output = float("inf"), 0, ""
    for _ in range(REPEATS):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "golden.cli", *argv], capture_output=True,
                              text=True)
        best = min(best, time.perf_counter() - start)
        status, output = status or done.returncode, done.stdout + done.stderr
    return best, status, output


def layers_of(path) -> int:
    c = json.loads((path / "config.json").read_text())
    return c.get("num_hidden_layers") or c.get("encoder_layers")


def checked(output) -> int:
    """N of the summary's "N of M layers checked"."""
    line = next(x for x in output.splitlines() if x.startswith("summary: "))
    return int(re.match(r"summary: (\d+) of", line).group(1))


def measure(name, path, k) -> dict:
    k = min(k, layers_of(path))
    one, status1, out1 = timed(["hf", str(path), "--layers", "0:1", "--no-cache"])
    many, status_k, out_k = timed(["hf", str(path), "--layers", f"0:{k}", "--no-cache"])
    n1, nk = checked(out1), checked(out_k)  # layers of every stack: Whisper's three
    damaged = path.parent / f"{name}-damaged"
    shutil.rmtree(damaged, ignore_errors=True)
    shutil.copytree(path, damaged)
    config = json.loads((damaged / "config.json").read_text())
    for key in ("num_hidden_layers", "encoder_layers"):
        if key in config:
            config[key] += 1
    (damaged / "config.json").write_text(json.dumps(config))
    refused, status_d, _ = timed(["hf", str(damaged), "--no-cache"])
    tokens = re.search(r"batch \d+, (\d+) tokens", out_k)
    return {"name": name, "first": one, "per_layer": (many - one) / max(nk - n1, 1),
            "layers": (n1, nk), "ok": status1 == 0 and status_k == 0, "refused": refused,
            "refused_status": status_d, "tokens": tokens.group(1) if tokens else "?"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/attn-parity-hf-bench"))
    parser.add_argument("--layers", type=int, default=8, help="K: layers of the longer run")
    parser.add_argument("--only", action="append", choices=list(SHAPES), default=[])
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = [measure(n, make(n, args.dir), args.layers) for n in (args.only or SHAPES)]
    cpu = _cpu()
    print(f"host: {cpu}; {platform.machine()}; python {platform.python_version()}")
    print("| checkpoint | tokens drawn | whole command, first layer (s) | per further layer (s) "
          "| passed | damaged copy: exit status, time (s) |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for r in rows:
        n1, nk = r["layers"]
        print(f"| {r['name']} | {r['tokens']} | {r['first']:.1f} ({n1} layer"
              f"{'s' if n1 > 1 else ''}) | {r['per_layer']:.2f} ({nk - n1} more) | "
              f"{'yes' if r['ok'] else 'NO'} | {r['refused_status']}, {r['refused']:.1f} |")
    return 0 if all(r["ok"] for r in rows) else 1


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
