"""How fast `ultrafast train-draft` can go on this CPU: tokens/s of each forward that can give the training features,
and of a training step in each precision, before committing to a whole run.

    python -m ultrafast.benchmarks.train_rates [--model smollm2-135m] [--seq-len 768] [--sequences 2] [--threads 2]
                                               [--precisions fp32,bf16] [--json F]

Features: `training.features.sequence_features` (one forward at position 0 and the greedy labels over every row,
as `extract` runs it) over --sequences sequences of --seq-len random tokens, after one as a warm-up, for the
packed kernels at 8-bit activations (where this CPU has integer kernels for the file's types), the bf16 forward
(`bf16.py`, as it chooses its multiplies on this CPU) and the engine at 16 bits (the held-out features). Training:
one sequence through `training.trainer.sequence_loss` and its backward, for a head of the default recipe's sizes,
in fp32 and under bf16 autocast (--precisions), best of two; its labels follow the text, so every row of every depth counts
(the most work a sequence can cost). Also printed: what `--features auto` and the training precision choose here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def feature_rates(loaded, seqs: list[list[int]]) -> dict[str, float]:
    from .. import kernels
    from ..engine import Engine
    from ..training.features import sequence_features

    forwards = {"bf16": {"bf16": True}, "packed": {}}
    if kernels.available():
        forwards = {"int8": {"activation_bits": 8}, **forwards}
    out = {}
    for name, options in forwards.items():
        try:
            engine = Engine.from_loaded(loaded, max_context=len(seqs[0]) + 16, device="cpu", **options)
        except ValueError as e:  # int8 on a CPU without integer kernels for these types
            print(f"  {name}: not on this CPU ({e})", file=sys.stderr)
            continue
        cache = engine.new_cache()
        sequence_features(engine, seqs[0], cache)  # warm-up: the caches and allocations of a whole sequence
        t = time.perf_counter()
        for ids in seqs:
            sequence_features(engine, ids, cache)
        out[name] = sum(map(len, seqs)) / (time.perf_counter() - t)
        print(f"  features, {name}: {out[name]:.0f} tokens/s ({engine.kernels_in_use()})", file=sys.stderr)
        del engine, cache
    return out


PRECISIONS = {"fp32": False, "bf16": True}  # name -> under bf16 autocast


def training_rates(engine, seq_len: int, precisions: list[str]) -> dict[str, float]:
    from ..draft_head import DraftHead, HeadConfig
    from ..training import Recipe
    from ..training.trainer import sequence_loss

    r, c = Recipe(), engine.config
    vd = r.vocab_for(c.vocab_size)
    head = DraftHead(HeadConfig.for_target(c, vd, r.ffn_for(c.dim, c.ffn_dim)), torch.arange(vd))
    head.attach_target(engine.model)
    for n, p in head.named_parameters():
        p.requires_grad_(n.split(".")[0] in DraftHead.TRAINED)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, vd, (seq_len,), generator=g)
    feats = torch.randn(seq_len, c.dim, generator=g)
    greedy = torch.roll(toks, -1)  # the text is the greedy path: every deeper row counts
    emb = engine.model.tok_embeddings(toks).float()
    out = {}
    for name in precisions:
        autocast = PRECISIONS[name]
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss, _ = sequence_loss(head, emb, feats, toks, greedy, r.depth, r.reg_weight)
            loss.backward()
            head.zero_grad(set_to_none=True)
            best = min(best, time.perf_counter() - t)
        out[name] = seq_len / best
        print(f"  training, {name}: {out[name]:.0f} tokens/s (depth {r.depth}, draft vocabulary {vd})", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ultrafast.benchmarks.train_rates", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seq-len", type=int, default=768)
    p.add_argument("--sequences", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precisions", default="fp32,bf16",
                   help="training precisions to time: fp32 and/or bf16 (autocast; where the CPU has no bf16 multiplier "
                        "it can take minutes a sequence)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    precisions = [v for v in args.precisions.split(",") if v]
    if not precisions or any(v not in PRECISIONS for v in precisions):
        print(f"error: --precisions takes fp32 and/or bf16, got {args.precisions!r}", file=sys.stderr)
        return 2
    if args.seq_len < 32 or args.sequences < 1:
        print("error: --seq-len must be at least 32 and --sequences at least 1", file=sys.stderr)
        return 2
    from ..engine import Engine
    from ..loader import load
    from ..pull import resolve_model
    from ..training import Recipe, choices_for

    torch.set_num_threads(args.threads)
    try:
        path = resolve_model(args.model)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loaded = load(path)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(100, min(20000, loaded.config.vocab_size), (args.seq_len,), generator=g).tolist()
            for _ in range(args.sequences)]
    print(f"train_rates: {path.name}, {args.sequences} x {args.seq_len} tokens, {args.threads} threads", file=sys.stderr)
    features = feature_rates(loaded, seqs)
    engine = Engine.from_loaded(loaded, max_context=args.seq_len + 16, device="cpu")
    training = training_rates(engine, args.seq_len, precisions)
    features_forward, autocast = choices_for(Recipe(), engine)
    chosen = {"features": features_forward, "training": "bf16" if autocast else "fp32"}
    print(f"  train-draft would take: features {chosen['features']}, training {chosen['training']}", file=sys.stderr)
    result = {"model": path.name, "seq_len": args.seq_len, "sequences": args.sequences, "threads": args.threads,
              "feature_tokens_per_s": {k: round(v, 1) for k, v in features.items()},
              "training_tokens_per_s": {k: round(v, 1) for k, v in training.items()}, "chosen": chosen}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
