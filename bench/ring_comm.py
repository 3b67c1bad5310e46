"""Ring attention's communication on paper, and measured on 8 virtual CPU devices.

    python bench/ring_comm.py --batch 1 --heads 32 --kv-heads 8 --length 131072 --dim 128 \\
        --devices 8 --dtype bfloat16
    python bench/ring_comm.py --batch 1 --heads 4 --kv-heads 2 --length 32768 --dim 64 \\
        --devices 8 --dtype float32 --measure [--backward] [--repeats N]

On paper (always printed): the bytes each device sends per step of the ring and in all, against
all-gathering K and V; what the zig-zag layout's moves add; and the condition for the transfer
of a block to hide behind its computation, on a v5e-class TPU and an H100 NVLink host, as the
least L / P at which it holds. Shape legend: B batch, H query heads, Hkv key-value heads, L
sequence length, D head width (Dk = Dv), P devices along the sequence, s bytes per element.

--measure (P ≤ 8): sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts,
compiles jax_attn.ring_attention (causal, layout "zigzag") for these shapes, reads every
collective-permute from the compiled program (its shape, its source-target pairs and how many
times its loop runs) and prints the bytes each device sends against the formula; then times the
ring on P virtual devices against the single-device blockwise path
(jax_attn.scaled_dot_product_attention, implementation="blockwise") on one, as golden.bench
times its long rows (a first call, then steady calls, the median). The virtual devices share
this machine's cores, so the ratio is the ring's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

# Published figures (peak dense bfloat16 matmul rate, one-way bandwidth of the link a device
# sends its block over):
# - TPU v5e: 197 TFLOP/s bf16 per chip; inter-chip interconnect 400 GB/s bidirectional per chip
#   over 4 ICI ports (https://cloud.google.com/tpu/docs/v5e, "Key chip specifications"), so
#   100 GB/s per port both ways, 50 GB/s one way: a ring along one axis of the 2-D torus sends
#   over one port. (The JAX scaling book, https://jax-ml.github.io/scaling-book/tpus/, gives
#   4.5e10 B/s one way per v5e link.)
# - H100 SXM: 989 TFLOP/s dense bf16 (the datasheet's 1,979 is with 2:4 sparsity); NVLink 4
#   900 GB/s total per GPU, 450 GB/s each way (https://www.nvidia.com/en-us/data-center/h100/);
#   through the NVSwitch a GPU sends to its ring neighbour at the full one-way rate. Past the 8
#   GPUs of one NVLink host the ring crosses hosts: a DGX H100 has one 400 Gb/s InfiniBand
#   NDR port (ConnectX-7) per GPU for its compute fabric, 50 GB/s each way (NVIDIA DGX H100
#   User Guide, "Network Modules": https://docs.nvidia.com/dgx/dgxh100-user-guide/).
DEVICES = {"TPU v5e (ICI)": (197e12, 50e9), "H100 SXM (NVLink 4)": (989e12, 450e9),
           "H100 SXM, between hosts (InfiniBand NDR)": (989e12, 50e9)}
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
# FlashAttention-2's backward runs 5 products of the forward's size (S = Q Kᵀ again, dV, dP,
# dQ, dK) against the forward's 2: 2.5 times its flops.
BACKWARD_FLOPS = 2.5
MIB = 2.0**20


# ---- on paper -----------------------------------------------------------------------------------

def paper(b, h, hkv, length, d, p, dtype):
    """Bytes each device sends, by formula: a dict of named figures."""
    s, acc = BYTES[dtype], max(BYTES[dtype], 4)  # dK and dV travel as accumulated (≥ float32)
    block = b * hkv * (length // p) * d  # elements of one device's K (or V)
    whole = b * hkv * length * d
    return {
        "block": 2 * block * s,  # K and V of one device: what one step sends
        "ring_fwd": (p - 1) * 2 * block * s,
        "gather_fwd": (p - 1) * 2 * whole * s // p,  # each device receives (P − 1)/P of K and V
        "ring_bwd": (p - 1) * 2 * block * s + p * 2 * block * acc,  # K, V; dK, dV one hop more
        "gather_bwd": (p - 1) * 2 * whole * (s + acc) // p,  # gather K, V; reduce-scatter dK, dV
        # layout="zigzag": each device sends its slice of q, k, v out and of the output back
        # (and, in the backward, dO out and dQ, dK, dV back); a device that keeps a half of
        # its own sends less, so this is the most any device sends.
        "zigzag_fwd": (2 * b * h + 2 * b * hkv) * (length // p) * d * s,
        "held_ring": 2 * 2 * block * s,  # K and V in hand and in flight
        "held_gather": 2 * whole * s,
    }


def overlap(b, h, hkv, length, d, p, dtype, flops, link, causal):
    """(compute s, transfer s, least L / P) of one ring step, forward and backward, on a
    device of ``flops`` FLOP/s whose link sends ``link`` B/s one way."""
    s, acc, n = BYTES[dtype], max(BYTES[dtype], 4), length // p
    share = 0.5 if causal else 1.0  # zig-zag: every causal step computes half of its (n, n)
    fwd = (share * 4 * b * h * n * n * d / flops, 2 * b * hkv * n * d * s / link)
    bwd = (BACKWARD_FLOPS * fwd[0], 2 * b * hkv * n * d * (s + acc) / link)
    # compute ≥ transfer  ⇔  n ≥ (Hkv / H) · bytes · F / (factor · W)
    least_fwd = hkv / h * s * flops / (share * 2 * link)
    least_bwd = hkv / h * (s + acc) * flops / (share * 2 * BACKWARD_FLOPS * link)
    return fwd, bwd, least_fwd, least_bwd


def paper_tables(a) -> str:
    f = paper(a.batch, a.heads, a.kv_heads, a.length, a.dim, a.devices, a.dtype)
    p, mib = a.devices, lambda x: f"{x / MIB:,.1f} MiB"  # noqa: E731
    lines = [f"Ring attention on paper: B={a.batch}, H={a.heads}, Hkv={a.kv_heads}, "
             f"L={a.length}, D={a.dim}, P={p}, {a.dtype} (s = {BYTES[a.dtype]} bytes)", "",
             "| what each device sends | per step | steps | in all |",
             "| --- | ---: | ---: | ---: |",
             f"| ring, forward: its K and V block, 2·B·Hkv·(L/P)·D·s | {mib(f['block'])} | "
             f"P − 1 = {p - 1} | {mib(f['ring_fwd'])} |",
             f"| all-gather of K and V, forward: receives (P − 1)/P of them | — | — | "
             f"{mib(f['gather_fwd'])} |",
             f"| ring, backward: K and V (P − 1 hops), dK and dV (P hops, "
             f"{max(BYTES[a.dtype], 4)}-byte accumulators) | — | {p - 1} and {p} | "
             f"{mib(f['ring_bwd'])} |",
             f"| all-gather K, V + reduce-scatter dK, dV, backward | — | — | "
             f"{mib(f['gather_bwd'])} |",
             f"| layout=\"zigzag\" moves, forward (q, k, v out, output back; none for "
             f"\"zigzag_ordered\"; the backward moves as much) | — | 1 | "
             f"{mib(f['zigzag_fwd'])} |", "",
             f"The ring sends what the all-gather receives; what differs is memory and overlap: "
             f"K and V held per device {mib(f['held_ring'])} in the ring (a block in hand, one "
             f"in flight) against {mib(f['held_gather'])} gathered, and each ring step's "
             f"transfer can hide behind that step's computation:", "",
             "| device | peak bf16 | link, one way | step fwd: compute / transfer | hidden | "
             "least L/P fwd | step bwd: compute / transfer | hidden | least L/P bwd |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: |"]
    for name, (flops, link) in DEVICES.items():
        fwd, bwd, least_f, least_b = overlap(a.batch, a.heads, a.kv_heads, a.length, a.dim, p,
                                             a.dtype, flops, link, a.causal)
        us = lambda t: f"{t * 1e6:,.0f} µs"  # noqa: E731
        lines.append(f"| {name} | {flops / 1e12:.0f} TFLOP/s | {link / 1e9:.0f} GB/s | "
                     f"{us(fwd[0])} / {us(fwd[1])} | {'yes' if fwd[0] >= fwd[1] else 'no'} | "
                     f"{least_f:,.0f} | {us(bwd[0])} / {us(bwd[1])} | "
                     f"{'yes' if bwd[0] >= bwd[1] else 'no'} | {least_b:,.0f} |")
    mode = "causal (zig-zag: half of each step's (L/P)² scores)" if a.causal else "not causal"
    lines += ["", f"Compute: 4·B·H·(L/P)²·D flops a forward step, {mode}; the backward "
              f"{BACKWARD_FLOPS}× that, at the peak rate (real kernels reach perhaps half of "
              "it, which makes the condition easier to meet). Transfer: the step's bytes over "
              "one link one way. Least L/P: (Hkv/H)·bytes·F / (2·W) forward (bytes = s), "
              f"(Hkv/H)·(s + 4)·F / (2·{BACKWARD_FLOPS}·W) backward, doubled when causal; "
              "independent of B and D."]
    return "\n".join(lines)


# ---- measured: the compiled program -------------------------------------------------------------

_SIZES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) \(")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def collective_bytes(hlo: str, devices: int) -> dict:
    """From the text of a compiled program: {"sent": bytes each device sends, a list (P,);
    "ops": [(name, bytes per send, times run, ring?)]; "gathers": how many all-gather,
    all-to-all and all-reduce ops it holds}. An op inside a loop counts as often as the loop
    runs (XLA's known_trip_count); ``ring?`` says whether its pairs are i -> i + 1."""
    comps, current = {}, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            comps[current] = {"entry": line.startswith("ENTRY"), "lines": []}
        elif current is not None:
            comps[current]["lines"].append(line)
    runs = {name: 1 for name, c in comps.items() if c["entry"]}
    pending = list(runs)
    while pending:  # times each computation runs: a while body as often as its loop (None:
        name = pending.pop()  # unknown, the blockwise loops over blocks, which send nothing)
        for line in comps[name]["lines"]:
            for callee in re.findall(r"(?:body|condition|to_apply|calls)=%([\w.\-]+)", line):
                trip = _TRIP.search(line) if f"body=%{callee}" in line else None
                loop = " while(" in line and f"body=%{callee}" in line
                times = int(trip.group(1)) if trip else (None if loop else 1)
                total = None if times is None or runs[name] is None else runs[name] * times
                runs[callee] = None if total is None or runs.get(callee, 0) is None else (
                    runs.get(callee, 0) + total)
                pending.append(callee)
    ring = {(i, (i + 1) % devices) for i in range(devices)}
    sent, ops, gathers = [0] * devices, [], 0
    for name, c in comps.items():
        for line in c["lines"]:
            if re.search(r" (all-gather|all-to-all|all-reduce)(-start)?\(", line):
                gathers += 1
            if " collective-permute-start(" in line:
                raise ValueError("asynchronous collective-permutes are not read here (CPU only)")
            if " collective-permute(" not in line:
                continue
            result = line.split("=", 1)[1].split("collective-permute(")[0]
            size = sum(_SIZES[t] * _prod(dims) for t, dims in _SHAPE.findall(result))
            pairs = {tuple(map(int, x)) for x in re.findall(
                r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])}
            times = runs.get(name, 0)
            if times is None:
                raise ValueError(f"{name}, a loop with no known trip count, sends data")
            for src, dst in pairs:
                if src != dst:
                    sent[src] += size * times
            ops.append((line.split("=")[0].strip(), size, times, pairs == ring))
    return {"sent": sent, "ops": ops, "gathers": gathers}


def _prod(dims: str) -> int:
    n = 1
    for x in filter(None, dims.split(",")):
        n *= int(x)
    return n


def measure(a) -> str:
    """Bytes from the compiled program against the formula, and wall times."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import jax_attn
    from golden.bench import measure_long  # timed as golden.bench times its long rows

    if jax.device_count() < a.devices:
        raise SystemExit(f"--measure needs --devices ≤ {jax.device_count()}, got {a.devices}")
    mesh = Mesh(np.array(jax.devices()[:a.devices]), ("seq",))
    shapes = [(a.batch, a.heads, a.length, a.dim)] + [(a.batch, a.kv_heads, a.length, a.dim)] * 2
    ring = jax.jit(lambda q, k, v: jax_attn.ring_attention(q, k, v, mesh=mesh, is_causal=True))
    single = jax.jit(lambda q, k, v: jax_attn.scaled_dot_product_attention(
        q, k, v, is_causal=True, implementation="blockwise"))
    def grad(f):
        """(q, k, v, dO) -> (O, gradients of Σ O ⊙ dO), as a training step needs them."""
        def run(q, k, v, d_out):
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(d_out)
        return jax.jit(run)

    f = paper(a.batch, a.heads, a.kv_heads, a.length, a.dim, a.devices, a.dtype)
    shapes.append(shapes[0])  # dO, (B, H, L, D)
    structs = [jax.ShapeDtypeStruct(s, a.dtype) for s in shapes]
    lines = ["", f"Measured on {a.devices} of {jax.device_count()} virtual CPU devices "
             f"(jax {jax.__version__}), causal, layout \"zigzag\":", "",
             "| program | ring bytes per device (HLO) | formula | zig-zag moves, most per "
             "device (HLO) | formula | all-gather / all-to-all / all-reduce ops |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for what, fn, ring_formula, n_args in (("forward", ring, f["ring_fwd"], 3),
                                           ("forward + backward", grad(ring),
                                            f["ring_fwd"] + f["ring_bwd"], 4)):
        got = collective_bytes(fn.lower(*structs[:n_args]).compile().as_text(), a.devices)
        on_ring = sum(size * times for _, size, times, is_ring in got["ops"] if is_ring)
        moved = max(got["sent"]) - on_ring
        lines.append(f"| {what} | {on_ring:,} | {ring_formula:,} | {moved:,} | "
                     f"{f['zigzag_fwd'] * (1 if what == 'forward' else 2):,} | "
                     f"{got['gathers']} |")
    if BYTES[a.dtype] == 2:
        lines += ["", "XLA:CPU widens 16-bit collectives to float32 (a convert before each "
                  "collective-permute), so here the program moves twice the formula; the "
                  "lowered program, what a TPU or GPU compiles, sends the 16-bit arrays."]
    if a.no_time:
        return "\n".join(lines)
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal(s, dtype=np.float32), a.dtype) for s in shapes]
    lines += ["", f"Wall time, median of {a.repeats} steady calls after a first (compiling) "
              "call; other % = the machine's cores other processes kept busy:", "",
              "| pass | path | median ms | first call ms | other % |",
              "| --- | --- | ---: | ---: | ---: |"]
    passes = [("forward", ring, single, args[:3])]
    if a.backward:
        passes.append(("forward + backward", grad(ring), grad(single), args))
    for what, on_ring, alone, inputs in passes:
        rows = {}
        for path, fn in ((f"ring, {a.devices} virtual devices", on_ring),
                         ("blockwise, one device", alone)):
            m = measure_long(fn, inputs, a.repeats)
            rows[path] = m["median_ms"]
            other = m["other_cpu_pct"]
            lines.append(f"| {what} | {path} | {m['median_ms']:,.0f} | "
                         f"{m['first_call_ms']:,.0f} | "
                         f"{'—' if other is None else f'{other:.0f}'} |")
            print(lines[-1], file=sys.stderr, flush=True)
        ratio = rows[f"ring, {a.devices} virtual devices"] / rows["blockwise, one device"]
        lines.append(f"| {what} | ring ÷ one device | {ratio:.2f}× | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("batch", 1), ("heads", 32), ("kv-heads", 8), ("length", 131072),
                          ("dim", 128), ("devices", 8)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--dtype", choices=tuple(BYTES), default="bfloat16")
    parser.add_argument("--not-causal", dest="causal", action="store_false",
                        help="the overlap table without the causal mask")
    parser.add_argument("--measure", action="store_true",
                        help="also compile and time on 8 virtual CPU devices")
    parser.add_argument("--backward", action="store_true", help="--measure: time fwd+bwd too")
    parser.add_argument("--no-time", action="store_true", help="--measure: bytes only")
    parser.add_argument("--repeats", type=int, default=3, help="--measure: steady calls")
    a = parser.parse_args(argv)
    if a.heads % a.kv_heads or a.length % (2 * a.devices):
        parser.error("--heads must be a multiple of --kv-heads and --length of 2·--devices")
    print(paper_tables(a))
    if a.measure:
        print(measure(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
