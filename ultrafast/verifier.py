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
    return verify_tree(logits, drafts, list(range(len(drafts))), sampler)[0]


def verify_tree(logits: torch.Tensor, tokens: list[int], parents: list[int], sampler) -> tuple[list[int], list[int]]:
    """A token tree: logits [1 + n, V] of the root (row 0) and the n drafted nodes (node i's token tokens[i-1],
    its parent parents[i-1], 0 the root). From the root, the target samples its token; the walk moves to the
    child holding that token, if any, and samples again there. Returns (the emitted tokens, the accepted nodes
    in order). Every emitted token is the target's own sample at its position, so the output is the
    standard tier's; a chain is the tree whose node i's parent is i - 1."""
    if logits.shape[0] != len(tokens) + 1 or len(parents) != len(tokens):
        raise ValueError(f"{len(tokens)} drafted nodes need {len(tokens) + 1} rows of logits and one parent each, "
                         f"got {logits.shape[0]} rows and {len(parents)} parents")
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens, parents), start=1):
        if not 0 <= p < i:
            raise ValueError(f"node {i}'s parent {p} must come before it")
        children.setdefault(p, {}).setdefault(t, i)
    out, path, node = [], [], 0
    while True:
        s = sampler.sample(logits[node])
        out.append(s)
        node = children.get(node, {}).get(s)
        if node is None:
            return out, path
        path.append(node)
