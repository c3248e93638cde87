"""A token tree verified in one forward: its layout in the KV cache, the attention each node may see, and
keeping the accepted path.

Node 0 is the root, the last emitted token, at position `start`; every other node is a drafted token whose
parent comes before it. Node j is computed at position start + depth(j) (RoPE) and writes its keys and values
into cache row start + j (its slot). It attends rows 0..start (the context and the root), then the slots of
its ancestors from depth 1 down to itself: the very keys, in the same order, that feeding its path one token
at a time would give it, so with the batch-invariant kernels its logits are those bits. A chain is the tree
whose node j sits at depth j: slots and positions coincide and nothing moves. After verification the
accepted path's rows are moved to rows start+1, start+2, ..., where plain decoding would have written them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class TreeLayout:
    parents: list[int]  # parents[0] == -1 (the root); parents[j] < j
    start: int  # the root's position
    depths: list[int] = field(init=False)

    def __post_init__(self):
        if not self.parents or self.parents[0] != -1:
            raise ValueError("a token tree starts with its root (parent -1)")
        depths = [0]
        for j, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < j:
                raise ValueError(f"node {j}'s parent {p} must come before it")
            depths.append(depths[p] + 1)
        self.depths = depths

    def __len__(self) -> int:
        return len(self.parents)

    def ancestors(self, j: int) -> list[int]:
        """The nodes from depth 1 down to j (empty for the root)."""
        path = []
        while j > 0:
            path.append(j)
            j = self.parents[j]
        return path[::-1]

    def positions(self) -> torch.Tensor:
        return torch.tensor([self.start + d for d in self.depths], dtype=torch.long)

    @cached_property
    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [T, 2] int64: rows 0..start contiguous, then how many listed rows; the listed slots, int32)."""
        keys, extra = [], []
        for j in range(len(self)):
            path = self.ancestors(j)
            keys.append((self.start + 1, len(path)))
            extra.extend(self.start + a for a in path)
        return torch.tensor(keys, dtype=torch.long), torch.tensor(extra, dtype=torch.int32)

    @cached_property
    def mask(self) -> torch.Tensor:
        """[T, start + T] bool: which cache rows each node attends (the reference attention's mask)."""
        T = len(self)
        m = torch.zeros(T, self.start + T, dtype=torch.bool)
        m[:, :self.start + 1] = True
        for j in range(T):
            for a in self.ancestors(j):
                m[j, self.start + a] = True
        return m

    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents[1:], start=1))


def keep_path(cache, start: int, path: list[int]) -> None:
    """Move the rows of the accepted nodes `path` (depth 1, 2, ...) to rows start+1, start+2, ... in every
    layer (each node's slot is start + its index, never below its destination, so in order nothing is
    overwritten before it is read)."""
    if cache.mirror is not None:
        cache.mirror.keep_path(cache, start, path)
    for i, node in enumerate(path, start=1):
        if node != i:
            cache.k[:, :, start + i] = cache.k[:, :, start + node]
            cache.v[:, :, start + i] = cache.v[:, :, start + node]


def graft(tokens: list[int], parents: list[int], scores: list[float], chain: list[int], step_logp: float):
    """Join a chain of drafts (a lookup's: each token right with probability exp(step_logp) given the ones
    before) to a ranked tree below its root: where the chain runs along existing nodes their scores rise to
    the chain's, where it leaves them new nodes follow. Returns the tree re-ranked as `propose_tree` ranks
    (score descending, a parent before its children, numbered from 1, parent 0 the root)."""
    toks, pars, sc = list(tokens), list(parents), list(scores)
    node, ll = 0, 0.0
    for t in chain:
        ll += step_logp
        child = next((i for i in range(1, len(toks) + 1) if pars[i - 1] == node and toks[i - 1] == t), None)
        if child is None:
            toks.append(t)
            pars.append(node)
            sc.append(ll)
            child = len(toks)
        else:
            sc[child - 1] = max(sc[child - 1], ll)
        node = child
    # a parent is never less likely than its child: lift ancestors to their best descendant
    for i in range(len(toks), 0, -1):
        p = pars[i - 1]
        if p:
            sc[p - 1] = max(sc[p - 1], sc[i - 1])
    depth = [0] * (len(toks) + 1)
    for i in range(1, len(toks) + 1):
        depth[i] = depth[pars[i - 1]] + 1
    order = sorted(range(1, len(toks) + 1), key=lambda n: (-sc[n - 1], depth[n]))
    new_id = {0: 0}
    for i, n in enumerate(order, start=1):
        new_id[n] = i
    return [toks[n - 1] for n in order], [new_id[pars[n - 1]] for n in order], [sc[n - 1] for n in order]
