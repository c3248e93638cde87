"""Each linear of the model's decoder layers, and its LM head, through the packed kernel, with its weights from memory
and (the layers') from cache.

    python -m ultrafast.benchmarks.kernel_shapes [--model qwen2.5-coder-1.5b] [--ks 1,2,4,8,16] [--reps 5]
                                                 [--threads 2] [--activation-bits 16|8] [--vs-file-layout] [--json F]

For every linear of a decoder layer (q, k, v, o, gate, up, down) and every k: the time of one k-row product
(`kernels.qmatmul`: the kernel the fused layer runs, with x's preparation and the threads' start) with the weights streamed from memory (the same linear of every
layer in turn: all layers' copies are far larger than the caches) against the same product over the first
layer's copy only, called as many times (its bytes stay in the caches after the first call). Where the two
agree, the kernel is bound by its own instructions, not by the memory; the weight stream's GB/s and, on the
VNNI path, the share of the multiply peak (`kernels.multiply_peak`, measured in the same run) say how far it is
from either limit. The LM head (`output`) is one matrix far larger than the caches: from memory only. Best of --reps
per figure. --vs-file-layout (where the kernels read layouts of their own: every quantized type on the VNNI path, Q4_K
at --activation-bits 8 on the AVX2 integer kernels) also times, from memory, each linear on
the file's bytes where the kernels read their own layout of them (`PackedLinear.weights`), its sweeps taking turns
with the layout's in the same process: the layouts' gain, free of the minute-to-minute drift between two runs.
"""

from __future__ import annotations

import argparse
import time

import torch

from .. import kernels
from ..packed import PackedLinear
from . import figures_verb


def best_per_call(mods: list[PackedLinear], k: int, reps: int, file_layout: bool = False) -> list[float]:
    """Seconds per k-row product, best of `reps` sweeps over `mods` (one product each), on the bytes the kernels
    read on the path in use (`PackedLinear.weights`), and (file_layout) on the file's bytes, the two sweeps taking
    turns: one figure per kind of bytes."""
    x = torch.randn(k, mods[0].in_features)
    kinds = [[m.weights() for m in mods]] + ([[(m.raw, m.qtype) for m in mods]] if file_layout else [])
    best = [float("inf")] * len(kinds)
    for ws in kinds:
        kernels.qmatmul(x, *ws[0], mods[0].in_features, mods[0].act_bits)  # threads up, x's buffers
    for _ in range(reps):
        for i, ws in enumerate(kinds):
            t = time.perf_counter()
            for m, (w, qtype) in zip(mods, ws):
                kernels.qmatmul(x, w, qtype, m.in_features, m.act_bits)
            best[i] = min(best[i], time.perf_counter() - t)
    return [b / len(mods) for b in best]


def layer_linears(model) -> dict[str, list[PackedLinear]]:
    """Each packed linear of a decoder layer, by its name in the layer, with its copy in every layer."""
    out: dict[str, list[PackedLinear]] = {}
    for layer in model.layers:
        for name, m in layer.named_modules():
            if isinstance(m, PackedLinear):
                out.setdefault(name, []).append(m)
    return out


def run(model: str, ks: list[int], reps: int = 5, threads: int = 2, activation_bits: int = 16,
        vs_file_layout: bool = False) -> dict:
    from ..engine import Engine

    torch.set_num_threads(threads)
    engine = Engine.from_model(model, max_context=64, activation_bits=activation_bits)
    mats = layer_linears(engine.model)
    if not mats:
        raise ValueError(f"{model}: no packed weights (the CPU kernels did not build?)")
    info = engine.describe()
    vnni = "vnni" in info["kernels"]
    if vs_file_layout and all(m.weights()[1] == m.qtype for ms in mats.values() for m in ms):
        raise ValueError("--vs-file-layout compares the kernels' own layouts with the file's; the kernels in use read "
                         "the file's bytes of every linear here")
    head = engine.model.output
    if isinstance(head, PackedLinear):  # the LM head: one matrix, far larger than the caches (no cached figure)
        mats["output"] = [head]
    peaks = [kernels.multiply_peak(threads)] if vnni else []
    rows = []
    for name, mods in mats.items():
        m = mods[0]
        for k in ks:
            memory = best_per_call(mods, k, reps, vs_file_layout)
            cached = best_per_call([m] * len(mods), k, reps)[0] if name != "output" else None
            rows.append({"linear": name.split(".")[-1], "qtype": m.qtype, "qtype_read": m.weights()[1],
                         "out": m.out_features, "in": m.in_features, "act_bits": m.act_bits, "k": k,
                         "memory_ms": memory[0] * 1e3, "cached_ms": cached * 1e3 if cached is not None else None,
                         "memory_gb_s": m.raw.numel() / memory[0] / 1e9,
                         "file_layout_ms": memory[1] * 1e3 if vs_file_layout else None})
    # the peak again after the products, the higher kept: a shared host sometimes holds one of the threads back
    peak = max(peaks + [kernels.multiply_peak(threads)], key=lambda p: p.vpdpbusd_per_s) if vnni else None
    for x in rows:
        macs_per_s = x["k"] * x["in"] * x["out"] / (x["memory_ms"] / 1e3)
        x["pct_of_peak"] = 100 * macs_per_s / peak.macs_per_s(x["act_bits"]) if peak else None
    return {"model": model, "kernels": info["kernels"], "threads": threads, "layers": len(engine.model.layers),
            "vpdpbusd_per_s": peak.vpdpbusd_per_s if peak else None, "rows": rows}


def format_table(r: dict) -> str:
    head = (f"{r['model']}, {r['kernels']}, {r['threads']} threads; each figure the best of the runs; memory: the "
            f"linear of each of the {r['layers']} layers in turn, cached: the first layer's again")
    vs = any(x.get("file_layout_ms") is not None for x in r["rows"])
    lines = [head, f"{'linear':>8} {'shape':>12} {'k':>3} {'memory ms':>10} {'cached ms':>10} {'memory/cached':>14} "
                   f"{'GB/s':>6} {'% of peak':>10}" + (f" {'file layout ms':>15} {'layout/file':>12}" if vs else "")]
    for x in r["rows"]:
        pct = f"{x['pct_of_peak']:.0f}%" if x["pct_of_peak"] is not None else "-"
        cached = (f"{x['cached_ms']:>10.3f} {x['memory_ms'] / x['cached_ms']:>14.2f}" if x["cached_ms"] is not None
                  else f"{'-':>10} {'-':>14}")
        line = (f"{x['linear']:>8} {str(x['out']) + 'x' + str(x['in']):>12} {x['k']:>3} {x['memory_ms']:>10.3f} "
                f"{cached} {x['memory_gb_s']:>6.1f} {pct:>10}")
        if vs:
            line += f" {x['file_layout_ms']:>15.3f} {x['memory_ms'] / x['file_layout_ms']:>12.2f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ultrafast.benchmarks.kernel_shapes")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--ks", default="1,2,4,8,16", help="rows per product, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--activation-bits", type=int, choices=(16, 8), default=16,
                    help="the quantized linears' activations: 16 (default) or 8 (llama.cpp's)")
    ap.add_argument("--vs-file-layout", action="store_true",
                    help="also time each linear on the file's bytes, taking turns with the kernels' own layout")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    try:
        ks = [int(v) for v in args.ks.split(",")]
    except ValueError:
        ap.error(f"--ks: comma-separated row counts expected, got {args.ks!r}")
    if any(k < 1 for k in ks) or args.reps < 1 or args.threads < 1:
        ap.error("--ks, --reps and --threads must be positive")
    return figures_verb(lambda: run(args.model, ks, args.reps, args.threads, args.activation_bits, args.vs_file_layout),
                        format_table, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
