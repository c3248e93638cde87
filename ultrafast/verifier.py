"""Verification: from the target's logits at the k+1 verified positions and the k drafts to the emitted tokens.

Position j's token is drawn with the request's own sampler, exactly as the standard tier draws it (one uniform
per emitted token, in order), and the walk goes on only while it equals draft j. Greedy, this is "the longest
prefix equal to the target's argmax, plus one bonus token"; sampled, it keeps a draft exactly when the target's
own sample equals it, so the emitted tokens are the standard tier's for the same seed whatever was drafted.
Drafts that a drafter sampled are drawn with the uniform the target uses at their position (`Sampler.draft`),
which is what makes them agree often.
"""

from __future__ import annotations

import torch


def verify(logits: torch.Tensor, drafts: list[int], sampler) -> list[int]:
    """logits [len(drafts)+1, V] -> the emitted tokens (at least one); records them in the sampler's history."""
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} rows of logits, got {logits.shape[0]}")
    out = []
    for j in range(len(drafts) + 1):
        s = sampler.sample(logits[j])
        out.append(s)
        if j == len(drafts) or s != drafts[j]:
            break
    return out
