"""One sampled token's cost: the fused C++ rule (`kernels.sample_row`, what `Sampler` runs) against the PyTorch rule
(`sample_from(probabilities(...))`), on a model's own logits.

    python -m ultrafast.benchmarks.sampling [--model qwen2.5-coder-1.5b] [--temperature 0.8] [--top-p 0.95]
                                            [--top-k 0] [--min-p 0] [--reps 200]

The model reads a short chat prompt; on the logits of its next position each rule draws a token for --reps uniforms,
the two taking turns, and the median time per token of each is printed with how many of the draws agree (they differ
only where a uniform falls within the rounding of a boundary between two tokens). A best-of-N step samples N such rows
after its batched forward.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from .. import kernels
from ..sampler import SamplingParams, probabilities, sample_from


def run(model: str, params: SamplingParams, reps: int, threads: int = 2) -> dict:
    from ..engine import Engine

    if not kernels.available():
        raise ValueError("the C++ kernels did not build: there is no fused rule to compare")
    torch.set_num_threads(threads)
    engine = Engine.from_model(model, max_context=256, draft_head="none")
    prompt = engine.chat_prompt([{"role": "user", "content": "Write a Python function that merges two sorted lists."}])
    logits = engine.forward(prompt, 0)[-1].float().contiguous()
    us = torch.rand(reps, generator=torch.Generator().manual_seed(0), dtype=torch.float64).tolist()
    fused_s, torch_s, agree = [], [], 0
    p = params
    for u in us:
        t = time.perf_counter()
        a = kernels.sample_row(logits, p.temperature, p.top_k, p.top_p, p.min_p, u)
        fused_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        b = sample_from(probabilities(logits, p), u)
        torch_s.append(time.perf_counter() - t)
        agree += a == b
    kept = int((probabilities(logits, p) > 0).sum())
    return {"model": model, "vocab": logits.numel(), "kept_tokens": kept, "temperature": p.temperature,
            "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p, "reps": reps, "threads": threads,
            "fused_ms": statistics.median(fused_s) * 1e3, "torch_ms": statistics.median(torch_s) * 1e3,
            "agree": agree}


def main(argv=None) -> int:
    from ..pull import PullError

    ap = argparse.ArgumentParser(prog="python -m ultrafast.benchmarks.sampling")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.reps < 1 or args.threads < 1:
        ap.error("--reps and --threads must be positive")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
        if params.greedy:
            raise ValueError("--temperature 0 is greedy (argmax): nothing to sample")
        r = run(args.model, params, args.reps, args.threads)
    except (ValueError, FileNotFoundError, PullError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{r['model']}: one token from {r['vocab']} logits (T = {r['temperature']}, top_p = {r['top_p']}, top_k = "
          f"{r['top_k']}, min_p = {r['min_p']}: {r['kept_tokens']} tokens kept), median of {r['reps']}, "
          f"{r['threads']} threads")
    print(f"  fused (kernels.sample_row): {r['fused_ms']:.3f} ms")
    print(f"  PyTorch rule:               {r['torch_ms']:.3f} ms ({r['torch_ms'] / r['fused_ms']:.1f}x)")
    print(f"  the same token in {r['agree']} of {r['reps']} draws")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
