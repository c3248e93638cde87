"""Decode step time with the weights on transparent huge pages (as built at load) against the same bytes on 4 KB pages.

    python -m ultrafast.benchmarks.hugepages [--model qwen2.5-coder-1.5b] [--steps 50] [--rounds 3]

One engine; the bytes its kernels stream (the linears' own layouts on the VNNI kernels, else the file's bytes) are
rebound, round by round, to those made at load (huge pages, see ultrafast/hugepages.py) or to plain copies of the same
bytes (ordinary allocations: 4 KB pages when THP is "madvise"). Each round times `--steps` single-token forwards at the same position after a 128-token prompt
and keeps the median; the two layouts alternate so that the machine's drift hits both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..hugepages import huge_bytes
from ..packed import PackedLinear


def step_ms(engine, cache, pos: int, steps: int) -> float:
    times = []
    for i in range(steps):
        t = time.perf_counter()
        engine.forward([300 + i % 7], pos, cache=cache)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main(argv=None) -> int:
    from ..engine import Engine

    ap = argparse.ArgumentParser(prog="python -m ultrafast.benchmarks.hugepages")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--steps, --rounds and --threads must be positive")
    torch.set_num_threads(args.threads)
    engine = Engine.from_model(args.model, max_context=512)
    mods = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
    if not mods:
        ap.error(f"{args.model}: no packed weights (the CPU kernels did not build?)")
    huge = [m.weights()[0] for m in mods]  # what the kernels stream: their layouts or the file's bytes
    plain = [r.clone() for r in huge]  # ordinary allocations

    def bind(m, r):  # the kernels read r from now on
        if m.raw_layout is not None:
            m.raw_layout = r  # (`_layout_of` stays `raw`: the layout is not made again)
        else:
            m.raw = r
    cache = engine.new_cache()
    prompt = list(range(100, 228))
    engine.forward(prompt, 0, cache=cache)
    res = {"huge pages": [], "4 KB pages": []}
    for _ in range(args.rounds):
        for name, raws in (("huge pages", huge), ("4 KB pages", plain)):
            for m, r in zip(mods, raws):
                bind(m, r)
            step_ms(engine, cache, len(prompt), 3)  # warm
            res[name].append(step_ms(engine, cache, len(prompt), args.steps))
    hb = huge_bytes()
    gb = sum(r.numel() for r in huge) / 1e9
    print(f"{args.model}: {gb:.2f} GB of packed weights; process memory on huge pages: "
          f"{'unknown' if hb is None else f'{hb / 1e9:.2f} GB'}")
    for name, v in res.items():
        print(f"{name:>11}: median ms per decode step by round {', '.join(f'{x:.2f}' for x in v)}")
    a, b = statistics.median(res["huge pages"]), statistics.median(res["4 KB pages"])
    print(f"4 KB pages / huge pages: {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
