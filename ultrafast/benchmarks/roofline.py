"""`ultrafast roofline`: how fast batch-1 decoding can go on bigger hardware, the seeds' argument in numbers.

At batch 1 each token reads every weight once, so tokens/s is bounded by (memory bandwidth) / (bytes of weights
read per token). Per model and hardware this prints that bound:

- this CPU: its read bandwidth measured in the same run (as `bench` measures it);
- N such machines with tensor parallelism: N x the bandwidth, each token paying two all-reduces per layer (after
  attention and after the MLP) of one hidden-size vector, at the latency of gloo's all-reduce measured here
  between two processes over loopback (a real network adds its own: this is the floor of that cost);
- GPUs (H100 SXM, H200) and a wafer-scale engine (Cerebras WSE-3, weights in on-chip SRAM), from their published
  bandwidth and capacity; a model larger than one device's memory takes several (GPUs: tensor parallel, the
  bandwidth adds up, the all-reduce is not counted; wafers: layers pipelined, one after another, so the bandwidth
  does not add up and the hops between wafers are not counted): bounds, never estimates of a product;
- the ultrafast tier on each: the bound x tau / r(k), with tau the tokens per pass and r(k) the cost of a
  k-row pass, physical (the longer of one weight stream and k rows of multiplies at the device's peak); where
  tau / r(k) is below 1 the tier drafts nothing and the bound is plain decoding's.

A pass takes the longer of its weight stream and its multiplies (at the device's peak), so the bound is the
roofline's: bandwidth-bound for every model here except on the wafer, where the multipliers bind first.

Models: the file given by --model (its exact bytes per token) and reference sizes from published parameter
counts (bytes per token ~ parameters x bits / 8).
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass

from .. import report

# published figures (datasheets): bandwidth in bytes/s, capacity in bytes, dense 16-bit multiply-adds per second
HARDWARE = {
    "H100 SXM": {"bandwidth": 3.35e12, "capacity": 80e9, "macs": 989e12 / 2,
                 "source": "NVIDIA H100 datasheet: 3.35 TB/s HBM3, 80 GB, 989 TFLOPS dense BF16"},
    "H200": {"bandwidth": 4.8e12, "capacity": 141e9, "macs": 989e12 / 2,
             "source": "NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 141 GB, 989 TFLOPS dense BF16"},
    "WSE-3 (wafer)": {"bandwidth": 21e15, "capacity": 44e9, "macs": 125e15 / 2, "pipelined": True,
                      "source": "Cerebras WSE-3 (March 2024): 44 GB on-chip SRAM, 21 PB/s, 125 PFLOPS"},
}

# reference models: (name, parameters, bits per weight, layers, hidden size), from their published configurations
REFERENCE_MODELS = [
    ("Llama-3.1-8B Q4_K_M", 8.0e9, 4.85, 32, 4096),
    ("Llama-3.1-70B Q4_K_M", 70.6e9, 4.85, 80, 8192),
    ("Llama-3.1-70B BF16", 70.6e9, 16, 80, 8192),
    ("Llama-3.1-405B FP8", 405e9, 8, 126, 16384),
]


@dataclass
class ModelFacts:
    name: str
    bytes_per_token: float
    macs_per_token: float
    layers: int
    dim: int


@dataclass
class Bound:
    model: str
    hardware: str
    devices: int
    tokens_per_s: float  # plain decoding's bound
    ultrafast_tokens_per_s: float
    r_k: float  # physical r(k) on this hardware
    note: str = ""


def _allreduce_worker(rank: int, world: int, port: int, dim: int, reps: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.zeros(dim)
    for _ in range(20):
        dist.all_reduce(x)
    # back to back, as a tensor-parallel decode issues them (two per layer, one after the other): the median of
    # five runs' mean
    runs = []
    for _ in range(5):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        runs.append((time.perf_counter() - t) / reps)
    if rank == 0:
        out.put(statistics.median(runs))
    dist.destroy_process_group()


def allreduce_latency(dim: int, world: int = 2, reps: int = 200) -> float:
    """Median seconds of one gloo all-reduce of `dim` fp32 values between `world` processes on this machine."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, world, port, dim, reps, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=300)
    finally:
        for p in procs:
            p.join(60)


def physical_r(k: int, bytes_per_token: float, bandwidth: float, macs_per_token: float, macs_per_s: float) -> float:
    """The longer of one weight stream and k rows of multiplies, over the same for one row."""
    one = max(bytes_per_token / bandwidth, macs_per_token / macs_per_s)
    return max(bytes_per_token / bandwidth, k * macs_per_token / macs_per_s) / one


def bounds(model: ModelFacts, *, cpu_bandwidth: float, cpu_macs: float, cpu_memory: float, allreduce_s: float,
           machines: list[int], tau: float, k: int) -> list[Bound]:
    out = []
    # a pass takes the longer of its weight stream and its multiplies; the ultrafast tier gains tau / r(k) where
    # that is above 1, and drafts nothing (plain decoding) where it is not
    for n in machines:
        t = (max(model.bytes_per_token / (n * cpu_bandwidth), model.macs_per_token / (n * cpu_macs))
             + (2 * model.layers * allreduce_s if n > 1 else 0.0))
        r = physical_r(k, model.bytes_per_token / n, cpu_bandwidth, model.macs_per_token / n, cpu_macs)
        fits = model.bytes_per_token / n <= cpu_memory
        out.append(Bound(model.name, "this CPU" if n == 1 else f"{n} x this CPU (TP)", n, 1 / t,
                         max(1.0, tau / r) / t, r, "" if fits else "does not fit in memory"))
    for name, h in HARDWARE.items():
        devices = max(1, math.ceil(model.bytes_per_token / h["capacity"]))
        # wafers take turns (layers pipelined): neither their bandwidth nor their multipliers add up
        bw, macs = (h["bandwidth"], h["macs"]) if h.get("pipelined") else (devices * h["bandwidth"],
                                                                            devices * h["macs"])
        t = max(model.bytes_per_token / bw, model.macs_per_token / macs)
        r = physical_r(k, model.bytes_per_token, bw, model.macs_per_token, macs)
        note = "" if devices == 1 else (f"{devices} wafers pipelined, hops not counted" if h.get("pipelined") else
                                        f"{devices} GPUs tensor-parallel, all-reduce not counted")
        out.append(Bound(model.name, name, devices, 1 / t, max(1.0, tau / r) / t, r, note))
    return out


def model_facts(path) -> ModelFacts:
    from ..engine import Engine

    e = Engine.from_model(str(path), max_context=256)
    c = e.config
    return ModelFacts(e.loaded.path.name, e.weight_bytes_per_token, e.model.macs_per_token(), c.n_layers, c.dim)


def format_table(rows: list[Bound], tau: float, k: int) -> str:
    lines = [f"{'model':24}{'hardware':22}{'devices':>8}{'plain tok/s':>13}{'ultrafast':>11}{'r(k)':>6}  note",
             f"{'':24}{'':22}{'':>8}{'(bound)':>13}{f'tau {tau:g}':>11}{f'k {k}':>6}"]
    def rate(v: float, width: int) -> str:
        return f"{v:{width},.0f}" if v >= 100 else f"{v:{width}.2g}"
    for b in rows:
        lines.append(f"{b.model[:23]:24}{b.hardware:22}{b.devices:8d}{rate(b.tokens_per_s, 13)}"
                     f"{rate(b.ultrafast_tokens_per_s, 11)}{b.r_k:6.2f}  {b.note}")
    return "\n".join(lines)


def plot(rows: list[Bound], path) -> None:
    """Plain decoding's bound per hardware, a group per model, log scale; the ultrafast bound as a hatched bar."""
    models = list(dict.fromkeys(b.model for b in rows))
    hw = list(dict.fromkeys(b.hardware for b in rows))
    width = 0.8 / len(hw)
    colours = ["tab:blue", "tab:cyan", "tab:purple", "tab:green", "tab:olive", "tab:red"]
    with report.figure(path, size=(10.0, 4.8)) as (fig, ax):
        for j, h in enumerate(hw):
            xs = [i + (j - (len(hw) - 1) / 2) * width for i in range(len(models))]
            got = {b.model: b for b in rows if b.hardware == h}
            ax.bar(xs, [got[m].ultrafast_tokens_per_s if m in got else 0 for m in models], width, fill=False,
                   hatch="//", edgecolor=colours[j % len(colours)], linewidth=0.6)
            ax.bar(xs, [got[m].tokens_per_s if m in got else 0 for m in models], width, label=h,
                   color=colours[j % len(colours)])
        ax.set_yscale("log")
        ax.set_xticks(range(len(models)), [m.replace(" ", "\n", 1) for m in models], fontsize=8)
        ax.set_ylabel("batch-1 tokens/s, memory-bandwidth bound")
        ax.set_title("The memory wall by hardware (solid: plain decoding; hatched: x tau / r(k))", fontsize=10)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=7, ncol=2)


def main(args) -> int:
    import torch

    from .. import kernels
    from .decode import measure_read_bandwidth

    if args.tau < 1 or args.draft_k < 1:
        raise ValueError("--tau must be >= 1 and --draft-k >= 1")
    machines = sorted({int(x) for x in args.machines.split(",")})
    if not machines or machines[0] < 1:
        raise ValueError("--machines: a comma-separated list of machine counts >= 1, e.g. 1,2,4,8")
    torch.set_num_threads(args.threads)
    bar = report.Progress(3, "roofline", "step")
    facts = [model_facts(args.model)] if args.model else []
    for name, params, bits, layers, dim in REFERENCE_MODELS:
        facts.append(ModelFacts(name, params * bits / 8, params, layers, dim))
    bar.update(1)
    bw = measure_read_bandwidth(args.threads) * 1e9
    mp = kernels.multiply_peak(args.threads) if kernels.vnni_supported() else None
    peak = mp.macs_per_s(16) if mp is not None else None
    cpu_macs = peak or 1e11
    bar.update(1)
    latency = {f.dim: allreduce_latency(f.dim) for f in facts}
    bar.update(1)
    bar.close()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rows = []
    for f in facts:
        rows += bounds(f, cpu_bandwidth=bw, cpu_macs=cpu_macs, cpu_memory=memory, allreduce_s=latency[f.dim],
                       machines=machines, tau=args.tau, k=args.draft_k)
    print(f"this CPU: read bandwidth {bw / 1e9:.1f} GB/s ({args.threads} threads, measured), multiply peak "
          f"{cpu_macs / 1e9:.0f} G int16 MAC/s ({'measured' if peak else 'assumed'}), memory {memory / 2**30:.0f} GiB")
    print("gloo all-reduce between 2 processes here (loopback), median: "
          + ", ".join(f"{d} values {1e6 * s:.0f} us" for d, s in latency.items())
          + "; two per layer per token under tensor parallelism")
    print(f"the ultrafast tier: tau {args.tau:g} tokens per pass (given), k = {args.draft_k} drafted rows, physical "
          "r(k) per hardware")
    print(format_table(rows, args.tau, args.draft_k))
    for name, h in HARDWARE.items():
        print(f"{name}: {h['source']}")
    report.write(args.json, {"cpu_read_bytes_per_s": bw, "cpu_macs_per_s": cpu_macs, "allreduce_s": latency,
                             "tau": args.tau, "draft_k": args.draft_k, "rows": [asdict(b) for b in rows]},
                 lambda png: plot(rows, png))
    return 0
