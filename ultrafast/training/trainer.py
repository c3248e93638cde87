"""Training a draft head on the target's features, and measuring it on held-out text.

Each sequence is run through the head `depth` times, as drafting runs it (HASS's / EAGLE-3's training-time
test): pass 1 reads the target's features; pass s reads pass s-1's predictions, and its row at position i
attends the pass-1 rows up to i-s+1 (the real context when drafting began) and its own chain's rows after
them, exactly the keys the drafter's cache holds at depth s. Each row is trained towards the target's
distribution at that position (soft cross-entropy over the draft vocabulary, the target's logits as the
teacher) and its feature (smooth L1 at unit RMS). Rows of pass s >= 2 count only where the text between the
chain's start and the row is the target's own greedy continuation: the situation drafting meets when its
earlier drafts were accepted.

The held-out report takes the same passes: depth s is accepted at a chain start when the chain's row at
depth s predicts the target's greedy token, counted only where the text so far is the greedy path and depths
1..s-1 were accepted. tau(k) = 1 + sum over s <= k of the product of the per-depth acceptances.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..draft_head import DraftHead, unit_rms


def chain_passes(head: DraftHead, emb: torch.Tensor, feats: torch.Tensor, depth: int):
    """emb [T, D], feats [T, D] (fp32) of one sequence -> per pass s = 1..depth: (positions [n_s], predicted
    features [n_s, D]), rows at positions s..T-1."""
    T = emb.shape[0]
    outs, ks, vs, ps = [], [], [], []
    prev = None
    for s in range(1, depth + 1):
        if T - s <= 0:
            break
        positions = torch.arange(s, T)
        fin = feats[:T - 1] if s == 1 else prev[:T - s]  # the feature at i-1 for rows i = s..T-1
        x = head.mix(emb[s:], fin)
        q, k, v = head.qkv(x, positions)
        ks.append(k)
        vs.append(v)
        ps.append(positions)
        masks = [ps[0][None, :] <= (positions - s + 1)[:, None]]
        for s2 in range(2, s + 1):
            masks.append(ps[s2 - 1][None, :] == (positions - s + s2)[:, None])
        attn = head.attend(q, torch.cat(ks), torch.cat(vs), torch.cat(masks, dim=1))
        prev = head.finish(x, attn)
        outs.append((positions, prev))
    return outs


def on_greedy_path(tokens: torch.Tensor, greedy: torch.Tensor, positions: torch.Tensor, s: int) -> torch.Tensor:
    """For rows of pass s at `positions`: whether tokens i-s+2..i are each the target's greedy token after the
    one before (the chain from i-s+1 followed the target's own continuation)."""
    ok = torch.ones(positions.shape[0], dtype=torch.bool)
    for back in range(0, s - 1):  # token at i - back must be greedy[i - back - 1]
        m = positions - back
        ok &= tokens[m] == greedy[m - 1]
    return ok


def teacher_probs(head: DraftHead, feats: torch.Tensor) -> torch.Tensor:
    """The target's distribution over the draft vocabulary at every row of feats [T, >= D] (no gradient)."""
    with torch.no_grad():
        return torch.softmax(head.logits(feats[:, :head.config.dim]), dim=-1)


def sequence_loss(head: DraftHead, emb, feats, tokens, greedy, depth: int, reg_weight: float = 1.0):
    """(loss, rows counted) of one sequence over `depth` passes. Every pass's row at position i is trained
    towards the same teacher (the target's distribution after feature i), computed once for the sequence."""
    total, rows = 0.0, 0
    teacher = None
    for s, (positions, pred) in enumerate(chain_passes(head, emb, feats, depth), start=1):
        keep = on_greedy_path(tokens, greedy, positions, s) if s > 1 else torch.ones(len(positions), dtype=torch.bool)
        if not keep.any():
            continue
        if teacher is None:  # pass 1 covers positions 1..T-1; deeper passes a subset of them
            teacher = teacher_probs(head, feats[1:])
        pos = positions[keep]
        pred, target = pred[keep], feats[pos, :head.config.dim]
        ce = -(teacher[pos - 1] * torch.log_softmax(head.logits(pred), dim=-1)).sum(-1)
        reg = F.smooth_l1_loss(unit_rms(pred), unit_rms(target), reduction="none").mean(-1)
        total = total + (ce + reg_weight * reg).sum()
        rows += int(keep.sum())
    return total, rows


@torch.no_grad()
def evaluate(head: DraftHead, data, embed, depth: int = 5) -> dict:
    """Held-out acceptance per depth and tau for chains of 1..depth drafts (module docstring)."""
    tried = [0] * (depth + 1)
    accepted = [0] * (depth + 1)
    t2d = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    t2d[head.draft_vocab] = torch.arange(head.draft_vocab.numel())
    in_vocab, n_tok = 0, 0
    for tokens, feats, greedy in data:
        emb = embed(tokens)
        feats = feats.float()
        T = tokens.numel()
        in_vocab += int((t2d[greedy] >= 0).sum())
        n_tok += T
        alive = torch.ones(T, dtype=torch.bool)  # per chain start p: depths so far all accepted
        for s, (positions, pred) in enumerate(chain_passes(head, emb, feats, depth), start=1):
            starts = positions - s + 1
            drafted = head.draft_vocab[head.logits(pred).argmax(-1)]
            counted = alive[starts] & on_greedy_path(tokens, greedy, positions, s)
            hit = counted & (drafted == greedy[positions])
            tried[s] += int(counted.sum())
            accepted[s] += int(hit.sum())
            alive[starts] = hit
    acc = [accepted[s] / tried[s] if tried[s] else 0.0 for s in range(1, depth + 1)]
    tau, prod = [1.0], 1.0
    for a in acc:
        prod *= a
        tau.append(tau[-1] + prod)
    return {"acceptance_by_depth": [round(a, 4) for a in acc], "tau_by_chain_length": [round(t, 3) for t in tau[1:]],
            "counted_by_depth": tried[1:], "greedy_in_draft_vocab": round(in_vocab / max(n_tok, 1), 4)}


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
