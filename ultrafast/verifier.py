"""Verification: from the target's logits at the k+1 verified positions and the k drafts to the emitted tokens.

Two rules, both lossless:

- `verify_point_mass`, for drafts that are not samples of a distribution (n-gram lookups; a draft model at
  temperature 0). Position j's token is drawn with the request's own sampler, exactly as the standard tier
  draws it (one uniform per emitted token), and the walk goes on only while it equals draft j. Greedy, this is
  "the longest prefix equal to the target's argmax, plus one bonus token"; with temperature it is the
  speculative-sampling rule for a point-mass draft, and the tokens are the standard tier's for the same seed.

- `verify_sampled`, for drafts x_j sampled from a draft distribution q_j (a draft model at temperature > 0):
  speculative sampling (Leviathan et al. 2023, Chen et al. 2023). Accept x_j with probability
  min(1, p_j(x_j) / q_j(x_j)); on the first rejection emit a token drawn from the residual max(0, p_j - q_j),
  normalised, and stop; when every draft is accepted, emit a bonus token drawn from p_k. Each emitted token is
  then distributed exactly as the target's p (the tokens differ from the standard tier's for the same seed,
  the distribution does not). p_j is the request's sampling distribution (penalties, temperature, top-k/p,
  min-p) given the tokens before it, and q_j must be the draft model's under the same transform.
"""

from __future__ import annotations

import torch

from .sampler import sample_from


def verify_point_mass(logits: torch.Tensor, drafts: list[int], sampler) -> list[int]:
    """logits [len(drafts)+1, V] -> the emitted tokens (at least one); records them in the sampler's history."""
    out = []
    for j in range(len(drafts) + 1):
        s = sampler.sample(logits[j])
        out.append(s)
        if j == len(drafts) or s != drafts[j]:
            break
    return out


def verify_sampled(logits: torch.Tensor, drafts: list[int], q: torch.Tensor, sampler) -> list[int]:
    """logits [k+1, V], drafts sampled from q [k, V] -> the emitted tokens; records them in the history."""
    if q.shape[0] != len(drafts):
        raise ValueError(f"{len(drafts)} drafts but {q.shape[0]} draft distributions")
    out = []
    for j, x in enumerate(drafts):
        p = sampler.distribution(logits[j])
        qj = _align(q[j], p)
        qx = float(q[j, x])
        if qx <= 0.0:
            raise ValueError(f"draft token {x} has probability 0 under its own draft distribution")
        # accept with probability min(1, p(x)/q(x)): u < p(x)/q(x), u uniform in [0, 1)
        if sampler.next_uniform() * qx < (float(p[x]) if x < p.numel() else 0.0):
            sampler.history.append(x)
            out.append(x)
            continue
        residual = torch.clamp(p - qj, min=0.0)
        total = float(residual.sum())
        # rejection implies p(x) < q(x), hence some token with p > q and a positive residual; rounding aside
        tok = sample_from(residual / total if total > 0 else p, sampler.next_uniform())
        sampler.history.append(tok)
        out.append(tok)
        return out
    tok = sample_from(sampler.distribution(logits[len(drafts)]), sampler.next_uniform())
    sampler.history.append(tok)
    out.append(tok)
    return out


def _align(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """q over p's vocabulary (a draft model's vocabulary may be a little shorter or longer than the target's:
    the target gives tokens past its own probability 0)."""
    n = p.numel()
    q = q.to(p.dtype)
    if q.numel() >= n:
        return q[:n]
    return torch.cat([q, q.new_zeros(n - q.numel())])
