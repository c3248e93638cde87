"""The trained draft head's drafter (`draft_head.py`: EAGLE's one-layer head on the target's features).

The head needs, at every position, the target's last-layer feature of the position before. The stepper hands
those over after each pass through `observe` (the features of the rows it kept: the prefill's, a verify
pass's accepted rows, a plain step's one row); the drafter runs them through the head when it next drafts, in
one batch, which both fills the head's own KV cache and gives its prediction of the feature at the last
emitted position. From there each draft token costs one 1-row head forward: its logits over the draft
vocabulary, the request's sampler's choice among them (`Sampler.draft`, as for the other drafters with
logits), that token's embedding and the predicted feature in again. Rows the head writes for drafts lie past
the last kept position and are overwritten, as the target's are.

Trees (EAGLE-2's dynamic draft tree, `propose_tree`): from the last emitted token the head expands, level by
level, the `beam` most likely nodes of the newest level (likelihood: the product of the head's probabilities
along the node's path) into their `branch` most likely children, each level one batched head forward whose
rows see only their own path (a mask over the head's cache). The nodes come back ranked by likelihood, so
any prefix of the ranking is a tree (a child is never likelier than its parent), and the stepper keeps as
many as the measured cost of verifying them pays for. For a sampled request every node's children also
include the sampler's own pick at that depth (`Sampler.draft`, the inverse CDF at the target's uniform).

A prefix the KV cache reused from an earlier request has no features here: the head's context then starts
where the prefill started (it drafts from what it has; exactness never depends on it).
"""

from __future__ import annotations

import torch


class HeadDrafter:
    name = "head"

    def __init__(self, engine, head, cost_per_token: float, max_len: int):
        c = head.config
        # what the target's forward hands over: its last layer's output, and those of the head's extra layers
        self.wants_hidden = tuple(c.extra_layers) or True
        self.engine, self.head, self.cost_per_token = engine, head, cost_per_token
        self.k = torch.zeros(max_len, c.n_kv_heads, c.head_dim)
        self.v = torch.zeros(max_len, c.n_kv_heads, c.head_dim)
        self.max_len = max_len
        # what a tree pass is expected to get accepted before this request has any record: the head's held-out
        # chain tau at its deepest measured length, less the bonus token (from its training report)
        tau = (getattr(head, "meta", {}).get("report", {}).get("heldout", {}).get("tau_by_chain_length") or [3.0])
        self.expected_accepted = max(0.0, float(tau[-1]) - 1.0)
        self._reset()

    def _reset(self) -> None:
        self.base = 0  # first position with a head row
        self.upto = 0  # head rows held for positions base..upto-1
        self.f_last = None  # the head's predicted feature at position upto-1 (its draft for upto comes from it)
        self.pending: list[tuple[int, list[int], torch.Tensor]] = []

    def begin(self, prompt_ids: list[int]) -> None:
        self._reset()

    def end(self, context: list[int]) -> None:
        self._reset()

    def observe(self, start_pos: int, features: torch.Tensor, tokens_after: list[int]) -> None:
        """The target's features at positions start_pos.. and the tokens at start_pos+1..: the head's inputs
        for positions start_pos+1.. (kept rows only)."""
        n = min(len(tokens_after), features.shape[0])
        if n:
            self.pending.append((start_pos + 1, list(tokens_after[:n]), features[:n].float()))

    def _flush(self) -> None:
        runs: list[tuple[int, list[int], list[torch.Tensor]]] = []  # contiguous rows go through the head together
        for pos, toks, feats in self.pending:  # (batched plain passes hand it one row at a time)
            if runs and runs[-1][0] + len(runs[-1][1]) == pos:
                runs[-1][1].extend(toks)
                runs[-1][2].append(feats)
            else:
                runs.append((pos, list(toks), [feats]))
        for pos, toks, feats in runs:
            if pos != self.upto:  # the first rows, or a gap (rows the head never saw): its context starts here
                self.base = pos
            self.f_last = self._rows(pos, toks, torch.cat(feats))[-1:]
            self.upto = pos + len(toks)
        self.pending = []

    @torch.inference_mode()
    def _rows(self, pos: int, toks: list[int], feats: torch.Tensor) -> torch.Tensor:
        """Head rows at positions pos..pos+n-1 (in those slots, causal) from those tokens and the features
        before them; returns the predicted features [n, D]."""
        n = len(toks)
        if pos + n > self.max_len:
            raise ValueError("past the head's KV cache")
        positions = torch.arange(pos, pos + n)
        keys = torch.arange(self.base, pos + n)
        return self._head_forward(toks, feats, positions, positions, keys[None, :] <= positions[:, None])

    def _head_forward(self, toks: list[int], feats: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
        """One head forward: rows for `toks` fed `feats`, at `positions`, their keys and values written into
        `slots` of the head's cache; row i attends cache rows base.. where mask[i] is True."""
        h = self.head
        emb = self.engine.model.tok_embeddings(torch.tensor(toks, dtype=torch.long)).float()
        x = h.mix(emb, feats)
        q, k, v = h.qkv(x, positions)
        self.k[slots], self.v[slots] = k, v
        end = self.base + mask.shape[1]
        return h.finish(x, h.attend(q, self.k[self.base:end], self.v[self.base:end], mask))

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, sampler=None) -> list[int]:
        self._flush()
        p = len(context)  # the next position; the head holds rows up to p - 1
        if k <= 0 or self.upto != p or self.f_last is None or p + k >= self.max_len:
            return []
        h, V = self.head, self.head.config.vocab_size
        history, drafts, f = list(context), [], self.f_last
        for i in range(k):
            logits = h.logits(f)[0]
            if sampler is None:
                tok = int(h.draft_vocab[int(torch.argmax(logits))])
            else:
                full = torch.full((V,), float("-inf"))
                full[h.draft_vocab] = logits
                tok = sampler.draft(full, history, i)
            drafts.append(tok)
            history.append(tok)
            if i + 1 < k:
                f = self._rows(p + i, [tok], f)
        return drafts

    # the tree's shape: levels (one batched head forward each), children per expanded node, nodes expanded
    tree_depth, tree_branch, tree_beam = 5, 3, 3

    @torch.inference_mode()
    def propose_tree(self, context: list[int], max_nodes: int, sampler=None):
        """Up to max_nodes drafted tokens as a tree below the last context token: (tokens, parents, scores),
        nodes numbered from 1 in order of decreasing score (the path's likelihood under the head), parent 0
        the root. Empty when the head is not in step with the context."""
        self._flush()
        p = len(context)
        depth, branch, beam = min(self.tree_depth, max_nodes), self.tree_branch, self.tree_beam
        if max_nodes <= 0 or self.upto != p or self.f_last is None or \
                p + depth * beam * (branch + 1) + 1 >= self.max_len:
            return [], [], []
        h, V = self.head, self.head.config.vocab_size
        greedy = sampler is None or sampler.params.greedy
        # nodes: token, parent (0 = root), depth, log-likelihood
        toks, parents, depths, scores = [], [], [], []
        frontier = [(0, self.f_last[0], 0.0)]  # (node, feature to draft its children from, log-likelihood)
        for d in range(1, depth + 1):
            children = []
            level_logits = h.logits(torch.stack([f for _, f, _ in frontier])).float()  # one product per level
            level_logp = torch.log_softmax(level_logits, dim=-1)
            top = torch.topk(level_logp, min(branch, level_logp.shape[1]))
            for row, (node, _, ll) in enumerate(frontier):
                cand = [(int(h.draft_vocab[i]), float(v)) for v, i in zip(top.values[row], top.indices[row])]
                if not greedy:  # the sampler's own pick at this depth joins the children
                    history = list(context) + self._path_tokens(node, toks, parents)
                    full = torch.full((V,), float("-inf"))
                    full[h.draft_vocab] = level_logits[row]
                    pick = sampler.draft(full, history, d - 1)
                    if pick not in [t for t, _ in cand]:
                        idx = (h.draft_vocab == pick).nonzero()
                        cand.append((pick, float(level_logp[row, idx[0, 0]]) if idx.numel() else -20.0))
                for t, lp in cand:
                    children.append((ll + lp, t, node))
            children.sort(key=lambda c: -c[0])
            if not children:
                break
            new = []
            for ll, t, parent in children:
                toks.append(t)
                parents.append(parent)
                depths.append(d)
                scores.append(ll)
                new.append(len(toks))  # node numbers from 1
            if d == depth:
                break
            expand = new[:beam]
            # one head forward for the expanded nodes: each at position p + d - 1, its slot p - 1 + node
            out = self._tree_rows(p, expand, toks, parents, depths, frontier)
            frontier = [(n, out[i], scores[n - 1]) for i, n in enumerate(expand)]
        # rank by likelihood (a parent before its children: never less likely, and shallower on a tie), keep the
        # best max_nodes, renumber: every prefix of the result is a tree
        order = sorted(range(1, len(toks) + 1), key=lambda n: (-scores[n - 1], depths[n - 1]))[:max_nodes]
        keep = set(order)
        order = [n for n in order if self._ancestors_in(n, parents, keep)]
        new_id = {0: 0}
        for i, n in enumerate(order, start=1):
            new_id[n] = i
        return ([toks[n - 1] for n in order], [new_id[parents[n - 1]] for n in order],
                [scores[n - 1] for n in order])

    @staticmethod
    def _ancestors_in(n: int, parents: list[int], keep: set) -> bool:
        while n:
            if n not in keep:
                return False
            n = parents[n - 1]
        return True

    @staticmethod
    def _path_tokens(node: int, toks: list[int], parents: list[int]) -> list[int]:
        path = []
        while node:
            path.append(toks[node - 1])
            node = parents[node - 1]
        return path[::-1]

    def _tree_rows(self, p: int, nodes: list[int], toks, parents, depths, frontier) -> torch.Tensor:
        """Head rows for tree nodes (same level): node n's token at position p + depth - 1 in slot p - 1 + n,
        fed its parent's predicted feature; each attends the context rows and its own path's slots."""
        parent_feat = {node: f for node, f, _ in frontier}
        slots = torch.tensor([p - 1 + n for n in nodes])
        positions = torch.tensor([p + depths[n - 1] - 1 for n in nodes])
        end = int(slots.max()) + 1
        mask = torch.zeros(len(nodes), end - self.base, dtype=torch.bool)
        mask[:, :p - self.base] = True
        for i, n in enumerate(nodes):
            m = n
            while m:
                mask[i, p - 1 + m - self.base] = True
                m = parents[m - 1]
        return self._head_forward([toks[n - 1] for n in nodes], torch.stack([parent_feat[parents[n - 1]] for n in nodes]),
                                  slots, positions, mask)
