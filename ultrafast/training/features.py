"""The target's own features over the training text: what a draft head learns from.

For every sequence the target (the packed engine users serve with) runs one forward and keeps, per position,
its last-layer hidden state before the final norm (bf16) and its greedy next token (the argmax of its own
logits: the label of self-distillation). Shards of about `SHARD_TOKENS` are written as they fill, so an
interrupted run resumes after the last complete shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SHARD_TOKENS = 16384
HEAD_CHUNK = 128  # rows per LM-head product when taking the greedy tokens


@dataclass
class Features:
    tokens: list[torch.Tensor]  # per sequence [T] int64
    feats: list[torch.Tensor]  # per sequence [T, D] bf16
    greedy: list[torch.Tensor]  # per sequence [T] int64: the target's argmax at each position


@torch.inference_mode()
def sequence_features(engine, ids: list[int], cache) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [T, D] bf16, greedy [T]) of one sequence, from a forward at position 0 in `cache`."""
    _, h = engine.forward(ids, 0, cache=cache, hidden=True)
    m = engine.model
    greedy = torch.cat([m.output(m.norm(h[i:i + HEAD_CHUNK])).argmax(-1) for i in range(0, h.shape[0], HEAD_CHUNK)])
    return h.to(torch.bfloat16), greedy


def extract(engine, seqs: list[list[int]], directory: Path, label: str, progress=None) -> Features:
    """Features of `seqs`, in shards `directory/label-NNNNN.pt`; shards already there (an earlier, interrupted
    run over the same sequences) are read back instead of recomputed. `progress(n_tokens)` after each one."""
    directory.mkdir(parents=True, exist_ok=True)
    out = Features([], [], [])
    cache = engine.new_cache()
    i, shard = 0, 0
    while i < len(seqs):
        path = directory / f"{label}-{shard:05d}.pt"
        if path.is_file():
            blob = torch.load(path, weights_only=True)
            n = len(blob["tokens"])
            if blob.get("first") != i or [t.tolist() for t in blob["tokens"]] != seqs[i:i + n]:
                raise ValueError(f"{path} holds other sequences: remove {directory} (or pass --restart)")
            if progress:
                progress(sum(t.numel() for t in blob["tokens"]))
        else:
            toks, feats, greedy, n_tok = [], [], [], 0
            while i + len(toks) < len(seqs) and n_tok < SHARD_TOKENS:
                ids = seqs[i + len(toks)]
                if len(ids) >= engine.max_context:
                    raise ValueError(f"a sequence of {len(ids)} tokens does not fit the context {engine.max_context}")
                f, g = sequence_features(engine, ids, cache)
                toks.append(torch.tensor(ids, dtype=torch.int32))
                feats.append(f)
                greedy.append(g.to(torch.int32))
                n_tok += len(ids)
                if progress:
                    progress(len(ids))
            blob = {"first": i, "tokens": toks, "feats": feats, "greedy": greedy}
            tmp = path.with_suffix(".tmp")
            torch.save(blob, tmp)
            tmp.replace(path)
            n = len(toks)
        out.tokens += [t.long() for t in blob["tokens"]]
        out.feats += list(blob["feats"])
        out.greedy += [g.long() for g in blob["greedy"]]
        i += n
        shard += 1
    return out

