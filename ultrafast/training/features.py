"""The target's own features over the training text: what a draft head learns from.

For every sequence the target (the packed engine users serve with) runs one forward and keeps, per position,
its last-layer hidden state before the final norm (bf16) and its greedy next token (the argmax of its own
logits: the label of self-distillation). Shards of about `SHARD_TOKENS` are written as they fill, so an
interrupted run resumes after the last complete shard.

With `continue_to`, the sequences are prompts and the target writes the rest itself: each prompt is continued
by its own greedy tokens (the text the ultrafast tier verifies at temperature 0), `batch` prompts at a time in
batched one-row passes (`Engine.forward_batch`), whose rows are bit-identical to running each sequence alone,
so the data does not depend on the batch size.
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
def sequence_features(engine, ids: list[int], cache, labels: bool = True,
                      layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [T, D] bf16, greedy [T]) of one sequence, from a forward at position 0 in `cache`.
    labels=False: only the last row's greedy token is computed (the LM head runs on one row); the others are -1.
    layers: also these layers' outputs, after the last layer's in each row ([T, (1 + len(layers)) * D])."""
    logits, h = engine.forward(ids, 0, cache=cache, hidden=tuple(layers) or True)
    if not labels:
        greedy = torch.full((h.shape[0],), -1, dtype=torch.long)
        greedy[-1] = logits[-1].argmax()
        return h.to(torch.bfloat16), greedy
    m = engine.model
    last = h[:, :engine.config.dim]
    greedy = torch.cat([m.output(m.norm(last[i:i + HEAD_CHUNK])).argmax(-1) for i in range(0, h.shape[0], HEAD_CHUNK)])
    return h.to(torch.bfloat16), greedy


class _Continuation:
    """One prompt being continued: its tokens so far, per-row features and greedy labels, and its cache."""

    def __init__(self, index: int, ids: list[int], engine, labels: bool = True, layers: tuple[int, ...] = ()):
        self.index, self.cache, self.prompt_len = index, engine.new_cache(), len(ids)
        f, g = sequence_features(engine, ids, self.cache, labels, layers)
        self.tokens, self.feats, self.greedy = list(ids), [f], [g]

    def next_token(self) -> int:
        return int(self.greedy[-1][-1])

    def result(self):
        return (torch.tensor(self.tokens, dtype=torch.int32), torch.cat(self.feats),
                torch.cat(self.greedy).to(torch.int32))


@torch.inference_mode()
def continue_greedily(engine, prompts, length: int, batch: int = 16, progress=None, new_tokens: int | None = None,
                      prompt_labels: bool = True, layers: tuple[int, ...] = ()):
    """Yields (index, (tokens [T] int32, features [T, D] bf16, greedy [T] int32)) for each (index, prompt ids) of
    the iterable `prompts`, continued by the target's greedy tokens until `length` tokens, `new_tokens` tokens
    generated (the last one only as a label) or an end token, in the order they finish. At most `batch` are
    continued at once, in batched one-row passes; a finished one's place goes to the next prompt. The last
    greedy label (the token not fed back) belongs to the last row. prompt_labels=False: the prompt's rows but
    its last get label -1 (the LM head skips them: for callers that need the continuation only)."""
    eos = engine.tokenizer.eos_ids
    prompts = iter(prompts)
    live: list[_Continuation] = []

    def done(c):
        return len(c.tokens) >= length or c.next_token() in eos or \
            (new_tokens is not None and len(c.tokens) - c.prompt_len + 1 >= new_tokens)

    while True:
        while len(live) < batch:
            nxt = next(prompts, None)
            if nxt is None:
                break
            index, ids = nxt
            if len(ids) >= length:
                raise ValueError(f"a prompt of {len(ids)} tokens leaves nothing to continue within {length}")
            c = _Continuation(index, ids, engine, prompt_labels, layers)
            if progress:
                progress(len(ids))
            if done(c):
                yield c.index, c.result()
            else:
                live.append(c)
        if not live:
            return
        rows = [([c.next_token()], len(c.tokens), c.cache) for c in live]
        logits, h = engine.forward_batch(rows, hidden=tuple(layers) or True)
        nxt_tok = logits.argmax(-1)
        for j, c in enumerate(live):
            c.tokens.append(rows[j][0][0])
            c.feats.append(h[j:j + 1].to(torch.bfloat16))
            c.greedy.append(nxt_tok[j:j + 1])
        if progress:
            progress(len(live))
        for c in [c for c in live if done(c)]:
            live.remove(c)
            yield c.index, c.result()


def _save_shard(path: Path, first: int, done: list) -> dict:
    blob = {"first": first, "tokens": [t for t, _, _ in done], "feats": [f for _, f, _ in done],
            "greedy": [g for _, _, g in done]}
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    tmp.replace(path)
    return blob


def extract(engine, seqs: list[list[int]], directory: Path, label: str, progress=None, *, continue_to: int = 0,
            budget: int | None = None, batch: int = 16, layers: tuple[int, ...] = ()) -> Features:
    """Features of `seqs`, in shards `directory/label-NNNNN.pt`; shards already there (an earlier, interrupted
    run over the same sequences) are read back instead of recomputed. engine: the target's engine, or a function
    that builds it (called only when some sequence is not in a shard yet). `progress(n_tokens)` as tokens are done.
    continue_to > 0: `seqs` are prompts, each continued greedily to that many tokens (module docstring), `batch`
    at a time. budget: no sequence is taken once the ones before it hold this many tokens (None: all). layers: the
    extra layers whose outputs follow the last layer's in each feature row (`sequence_features`)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = Features([], [], [])
    i, shard, held = 0, 0, 0

    def take(blob):
        nonlocal i, shard, held
        out.tokens.extend(t.long() for t in blob["tokens"])
        out.feats.extend(blob["feats"])
        out.greedy.extend(g.long() for g in blob["greedy"])
        held += sum(t.numel() for t in blob["tokens"])
        i += len(blob["tokens"])
        shard += 1

    def wanted():
        return i < len(seqs) and (budget is None or held < budget)

    while wanted() and (directory / f"{label}-{shard:05d}.pt").is_file():  # an earlier run's shards
        path = directory / f"{label}-{shard:05d}.pt"
        blob = torch.load(path, weights_only=True)
        n = len(blob["tokens"])
        stored = [t.tolist() for t in blob["tokens"]]
        if continue_to:
            stored = [t[:len(p)] for t, p in zip(stored, seqs[i:i + n])]
        if blob.get("first") != i or stored != seqs[i:i + n]:
            raise ValueError(f"{path} holds other sequences: remove {directory} (or pass --restart)")
        if progress:
            progress(sum(t.numel() for t in blob["tokens"]))
        take(blob)
    if not wanted():
        return out
    if not hasattr(engine, "forward"):  # a function that builds it
        engine = engine()

    pending: list = []  # finished sequences in order from index i on, not yet in a shard
    if continue_to:
        def prompts():  # handed out until the sequences already in order hold the budget
            for k in range(i, len(seqs)):
                if budget is not None and held + sum(t.numel() for t, _, _ in pending) >= budget:
                    return
                yield k, seqs[k]

        stream = continue_greedily(engine, prompts(), min(continue_to, engine.max_context), batch, progress,
                                   layers=layers)
    else:
        cache = engine.new_cache()

        def plain():
            for k in range(i, len(seqs)):
                ids = seqs[k]
                if len(ids) >= engine.max_context:
                    raise ValueError(f"a sequence of {len(ids)} tokens does not fit the context {engine.max_context}")
                f, g = sequence_features(engine, ids, cache, layers=layers)
                if progress:
                    progress(len(ids))
                yield k, (torch.tensor(ids, dtype=torch.int32), f, g.to(torch.int32))

        stream = plain()
    finished: dict = {}  # finished out of order (continuations end in the order of their lengths)
    for k, result in stream:
        finished[k] = result
        while i + len(pending) in finished:
            pending.append(finished.pop(i + len(pending)))
            n_tok = sum(t.numel() for t, _, _ in pending)
            last = i + len(pending) >= len(seqs) or (budget is not None and held + n_tok >= budget)
            if n_tok >= SHARD_TOKENS or last:
                take(_save_shard(directory / f"{label}-{shard:05d}.pt", i, pending))
                pending = []
                if last:
                    stream.close()
                    return out
    if pending:
        take(_save_shard(directory / f"{label}-{shard:05d}.pt", i, pending))
    return out
