"""The ultrafast tier: draft several tokens, verify them in one pass over the weights, keep what the target
itself would have produced.

Verification runs the last emitted token and the k drafts through the model in one forward (the packed
kernels make the logits of those k+1 rows bit-identical to k+1 one-token forwards), then walks the
positions in order with the request's own sampler (`verifier.py`), so the tokens are the standard tier's, for
greedy and seeded sampled requests alike. The KV cache needs no copy to roll back: rows written for rejected
drafts lie beyond the new position and are overwritten before anything attends to them.

The adaptive policy picks k per pass from the drafter's recent per-token acceptance rate a (accepted drafts
over trials in its last few passes: `DrafterStats.record`) and the measured cost r(n) of an n-row forward
relative to a 1-row one: expected tokens per pass (1 + a + ... + a^k) divided by the pass's cost
r(k+1) + c*k, c being what the drafter spends per drafted token in target 1-token forwards (0 for lookups;
measured for a draft model). The lookups are free, so all are asked, and the proposal with the best expected
gain is verified; their a is kept per class of proposal (`lookup_class`: the match length's, and apart for
prompt lookup's continuation of the text it was copying): a long match in a re-sent file earns long drafts
however the one-token matches fare. When no k > 0 beats a plain step it decodes plainly, probing again now
and then, so the tier is never meaningfully slower than standard.

A drafter that proposes trees (the draft head: `propose_tree`) returns its nodes ranked by its own likelihood
of each path; the stepper keeps the prefix of that ranking that maximises expected tokens per pass,
(1 + c * sum of the kept nodes' likelihoods) / (r(n + 1) + the drafting's cost), c calibrating the drafter's
likelihoods to what verification accepted so far, and verifies the tree in one forward (`token_tree.py`).
The lookups' matches join that tree (`token_tree.graft`), each token at its match class's acceptance rate.

Generations that decode together (a server's concurrent requests, best-of-n candidates) share passes: each
offers its lookups' best chain (`SpeculativeStepper.batch_plan`), the pass keeps the drafts that pay for their
rows across all of them (`share_rows`), and each verifies its own rows (`verify_rows`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from .token_tree import TreeLayout, graft, keep_path
from .verifier import verify_tree

MAX_K = 16  # the longest draft the policy considers (r(k) is measured up to k + 1 rows)


@dataclass
class DrafterStats:
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    rate: float = 0.6  # recent per-token acceptance, optimistic at first (`record`)
    # the same by class of proposal (lookup drafters: see lookup_class), so that a long match is not judged
    # by the short ones' record
    rates: dict[int, float] = field(default_factory=dict)
    # recent accepted drafts and trials (decayed sums) behind rate (key None) and rates (key: the class)
    counts: dict = field(default_factory=dict)
    # a tree drafter's recent passes (EMA): nodes accepted and nodes verified, optimistic at first
    tree_accepted: float = 2.0
    tree_nodes: float = 4.0

    DECAY = 0.7  # per pass: the last few passes count
    PRIOR_TRIALS = 2.0  # the optimistic start weighs as much as two trials

    def record(self, cls: int, accepted: int, trials: int) -> None:
        """A pass's outcome: `accepted` drafts of `trials` (the accepted ones and the first rejected, if any)
        at match class `cls`. The rates are accepted / trials over recent passes, so a long run of right
        drafts weighs by its tokens: one rejection at an edit of a file being copied lowers a long match's
        rate a little, not by the third that a per-pass average took (which then shortened the next drafts
        of the same copy)."""
        for key in (None, cls):
            a, t = self.counts.get(key, (DrafterStats.rate * self.PRIOR_TRIALS, self.PRIOR_TRIALS))
            a, t = self.DECAY * a + accepted, self.DECAY * t + trials
            self.counts[key] = (a, t)
            if key is None:
                self.rate = a / t
            else:
                self.rates[key] = a / t

    def to_json(self) -> dict:
        return {"passes": self.passes, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None}


@dataclass
class SpecStats:
    verify_passes: int = 0  # forwards after the prefill (plain steps included)
    emitted: int = 0  # tokens those passes produced
    plain_steps: int = 0
    cost: float = 0.0  # sum over passes of r(rows in the pass): the passes' cost in 1-token forwards
    draft_cost: float = 0.0  # what drafting those passes cost, in the same unit (0 for the lookups)
    by_drafter: dict[str, DrafterStats] = field(default_factory=dict)

    @property
    def spent(self) -> float:
        """The passes' cost with their drafting's, in 1-token forwards."""
        return self.cost + self.draft_cost

    def record_plain(self) -> None:
        self.verify_passes += 1
        self.emitted += 1
        self.plain_steps += 1
        self.cost += 1.0

    @property
    def tau(self) -> float:
        """Tokens per pass over the weights (accepted drafts + the bonus token)."""
        return self.emitted / self.verify_passes if self.verify_passes else 0.0

    def to_json(self) -> dict:
        return {"tau": round(self.tau, 4), "verify_passes": self.verify_passes, "plain_steps": self.plain_steps,
                "mean_r": round(self.cost / self.verify_passes, 4) if self.verify_passes else 1.0,
                "drafters": {k: v.to_json() for k, v in self.by_drafter.items()}}


def pass_gains(rate: float, r: list[float], limit: int, draft_cost: float = 0.0, fixed_cost: float = 0.0):
    """(gain, k) for k = 1..limit: a pass drafting k tokens, each accepted with probability `rate`, yields
    1 + rate + ... + rate^k tokens expected, and costs r(k+1) + draft_cost * k + fixed_cost target 1-token
    forwards (draft_cost: per drafted token; fixed_cost: spent before drafting at all, e.g. a catch-up);
    gain is their ratio, the speedup over a plain step."""
    expected = 1.0
    for k in range(1, limit + 1):
        expected += rate ** k
        yield expected / (r[k + 1] + draft_cost * k + fixed_cost), k


def expected_speedup(rate: float, r: list[float], draft_cost: float = 0.0, limit: int | None = None) -> tuple[float, int]:
    """The best expected speedup over plain decoding of drafting k >= 1 tokens (k up to limit), and that k
    (`pass_gains`). Below 1, the policy would not draft."""
    return max(pass_gains(rate, r, len(r) - 2 if limit is None else limit, draft_cost), default=(0.0, 0))


def speedup_ceiling(r: list[float]) -> tuple[float, int]:
    """The speedup over plain decoding if every draft were accepted, at the measured verify cost: the best
    (k + 1) / r(k + 1) over k, and that k. No drafter can beat it; on a CPU it is set by the multiply rate."""
    return max(((k + 1) / r[k + 1], k) for k in range(len(r) - 1))


def match_class(n: int) -> int:
    """Match lengths 1, 2-3, 4-7, 8-15, 16+ -> classes 1..5; 0: not a lookup (no match length)."""
    return min(5, max(0, int(n)).bit_length())


NEAR = 8  # added to the match class of a lookup's proposal that continues its copy (a drafter's `near`)


def lookup_class(d) -> int:
    """The class a lookup's last proposal is judged in: its match length's (`match_class`), apart for one that
    continued the text the drafter was copying (`near`, prompt lookup's anchor) from one matched elsewhere."""
    return match_class(getattr(d, "match_len", 0)) + (NEAR if getattr(d, "near", False) else 0)


def forward_times(engine, max_k: int = MAX_K, reps: int = 3, *, prefix: list[int] | None = None,
                  probe: list[int] | None = None, cache=None) -> list[float]:
    """t[n] = median seconds of an n-row forward (all logits), for n = 1..max_k+1 (t[0] unused).

    The rows are probe[:n] (default: token ids 0..n-1) at the position after `prefix` (default: 8 tokens),
    which is first written into `cache` (default: a scratch cache). The sizes take turns, one forward of each
    per round after a warm-up forward, so the host's drift during the measurement (its memory speed moves
    from minute to minute, which moves the one-row step against the multiply-bound larger passes) falls on all
    sizes alike: on the 1.5B at int8, six measurements of each way alternated gave r(8) a spread (sd) of 0.32
    against 0.50 when each size's forwards ran in a block, r(16) 0.60 against 1.04, the same means."""
    prefix = list(range(8)) if prefix is None else prefix
    probe = list(range(max_k + 1)) if probe is None else probe
    if len(probe) < max_k + 1:
        raise ValueError(f"measure_r needs {max_k + 1} probe tokens, got {len(probe)}")
    cache = engine.new_cache() if cache is None else cache
    engine.forward(prefix, 0, cache=cache)
    engine.forward(probe[:1], len(prefix), all_logits=True, cache=cache)  # warm-up: the threads, the first row
    samples: list[list[float]] = [[] for _ in range(max_k + 2)]
    for _ in range(reps):
        for n in range(1, max_k + 2):
            t = time.perf_counter()
            engine.forward(probe[:n], len(prefix), all_logits=True, cache=cache)
            samples[n].append(time.perf_counter() - t)
    return [0.0] + [sorted(ts)[len(ts) // 2] for ts in samples[1:]]


def measure_r(engine, max_k: int = MAX_K, reps: int = 3, *, prefix: list[int] | None = None,
              probe: list[int] | None = None, cache=None) -> list[float]:
    """r[n] = median time of an n-row forward / that of a 1-row forward, for n = 1..max_k+1 (r[0] unused),
    from `forward_times`. The adaptive policy measures it once per engine; `ultrafast bench` measures it after
    its prompt, with real tokens."""
    times = forward_times(engine, max_k, reps, prefix=prefix, probe=probe, cache=cache)
    return [t / times[1] for t in times]


class SpeculativeStepper:
    EMA = 0.3
    PROBE_EVERY = 8  # plain steps in a row before trying a one-token draft again (at least)
    PROBE_BUDGET = 0.03  # ... and no sooner than the probe's extra cost stays within this share of those steps

    def __init__(self, engine, cache, drafters: list, r: list[float], max_k: int = MAX_K, fixed_k: int | None = None):
        if not drafters:
            raise ValueError("the ultrafast tier needs at least one drafter")
        if fixed_k is not None and not 1 <= fixed_k <= len(r) - 2:
            raise ValueError(f"fixed draft length must be in 1..{len(r) - 2}, got {fixed_k}")
        self.engine, self.cache, self.drafters, self.r = engine, cache, drafters, r
        self.max_k = min(max_k, len(r) - 2)
        # fixed_k: no policy; every pass drafts fixed_k tokens, the drafters taking turns (an exactness check
        # that exercises every drafter and every rollback, `specbench --fixed-k`; slower than the policy)
        self.fixed_k, self._turn = fixed_k, 0
        self.stats = SpecStats(by_drafter={d.name: DrafterStats() for d in drafters})
        for d in drafters:  # a tree drafter's own estimate of what its trees get accepted (the head's report)
            if hasattr(d, "expected_accepted"):
                self.stats.by_drafter[d.name].tree_accepted = d.expected_accepted
        self._plain_run = 0
        self._tree_seen = [1.0, 1.0]  # (accepted nodes, predicted) decayed sums: the tree likelihoods' calibration
        self._tree_pred = 0.0  # the likelihood sum of the tree being verified
        # drafters that read the target's hidden states (a draft head): every pass hands them the kept rows'
        self._readers = [d for d in drafters if getattr(d, "wants_hidden", False)]
        specs = {d.wants_hidden for d in self._readers}
        if len(specs) > 1:
            raise ValueError("drafters that read different target layers cannot share a pass")
        # the `hidden` argument of the target's forward that the feature readers need: False (none), True (the
        # last layer's output) or the extra layers' indices whose outputs follow it (`Transformer.forward_multi`)
        self.wants_hidden: bool | tuple[int, ...] = specs.pop() if specs else False

    def observe(self, start_pos: int, features, tokens_after: list[int]) -> None:
        """The target's features (`wants_hidden`) at positions start_pos.. (rows that were kept) and the tokens that
        followed them: for drafters that read features (the prefill calls this too)."""
        for d in self._readers:
            d.observe(start_pos, features, tokens_after)

    def begin(self, prompt_ids: list[int]) -> None:
        for d in self.drafters:
            d.begin(prompt_ids)

    def end(self, context: list[int]) -> None:
        for d in self.drafters:
            d.end(context)

    def _best_k(self, rate: float, limit: int, draft_cost: float = 0.0, fixed_cost: float = 0.0) -> int:
        """k maximising expected tokens per unit of cost; 0 (a plain step) unless some k beats it by 2%.
        draft_cost: the drafter's cost per drafted token, in target 1-token forwards (0 for lookups);
        fixed_cost: what it must spend before drafting at all (a draft model catching up on the context)."""
        return self._best_k_gain(rate, limit, draft_cost, fixed_cost)[0]

    def _best_k_gain(self, rate: float, limit: int, draft_cost: float = 0.0,
                     fixed_cost: float = 0.0) -> tuple[int, float]:
        """`_best_k` and its expected gain (1.0 for a plain step)."""
        best_k, best_gain = 0, 1.0
        for gain, k in pass_gains(rate, self.r, limit, draft_cost, fixed_cost):
            if gain > best_gain * 1.02:
                best_k, best_gain = k, gain
        return best_k, best_gain

    def probe_interval(self, draft_cost: float = 0.0, fixed_cost: float = 0.0) -> int:
        """Plain steps between probes: a probe costs r(2) - 1 more than a plain step (plus the draft and its
        catch-up)."""
        extra = self.r[2] - 1 + draft_cost + fixed_cost
        return max(self.PROBE_EVERY * (1 + int(16 * draft_cost)), math.ceil(extra / self.PROBE_BUDGET))

    def tree_size(self, scores: list[float], parents: list[int], depth_limit: int, draft_cost: float) -> int:
        """How many of a ranked tree's nodes to verify (module docstring); nodes deeper than depth_limit are
        left out (with their descendants, which come later in the ranking)."""
        calib = self._tree_seen[0] / max(self._tree_seen[1], 1e-9)
        depths, expected, best_n, best_gain = [0], 1.0, 0, 1.02
        for n, (s, p) in enumerate(zip(scores, parents), start=1):
            depths.append(depths[p] + 1)
            if depths[-1] > depth_limit or n + 1 >= len(self.r):
                break
            expected += calib * math.exp(s)
            gain = expected / (self.r[n + 1] + draft_cost)
            if gain > best_gain:
                best_n, best_gain = n, gain
        return best_n

    def _draft(self, sampler, limit: int):
        """Ask drafters in order of recent acceptance; take the first that proposes something worth verifying.
        Returns (drafter, drafts, match class, parents): the match class 0 for a drafter that is no lookup;
        parents None for a chain, else each drafted node's parent (0: the root) in a tree."""
        context = sampler.history
        if self.fixed_k is not None:
            return self._draft_fixed(context, sampler, min(self.fixed_k, limit))
        order = sorted(self.drafters, key=lambda d: -self.stats.by_drafter[d.name].rate)
        lookups = [d for d in order if _is_lookup(d)]
        for d in order:
            st = self.stats.by_drafter[d.name]
            cost = getattr(d, "cost_per_token", 0.0)
            if _is_lookup(d):  # the lookups: all asked at once (they are free), the best proposal taken
                if d is lookups[0]:
                    drafted = self._draft_lookups(lookups, context, sampler, limit)
                    if drafted:
                        return drafted
                continue
            # a draft model first feeds what its cache lacks (the whole prompt, the first time): charged too
            catch_up = d.catch_up_cost(context) if hasattr(d, "catch_up_cost") else 0.0
            if hasattr(d, "propose_tree"):  # a tree costs its levels whatever is kept: judged by its recent passes
                tree_cost = _tree_cost(d)
                n_est = min(len(self.r) - 1, max(2, round(st.tree_nodes) + 1))
                worth = (1 + st.tree_accepted) / (self.r[n_est] + tree_cost) > 1.02
                if worth or self._plain_run >= self.probe_interval(tree_cost, catch_up):
                    drafted = self._draft_tree(d, context, sampler, limit, tree_cost)
                    if drafted:
                        return drafted
                continue
            k = self._best_k(st.rate, limit, cost, catch_up)
            # probe again after a run of plain steps: one token, as rarely as its cost asks (where a second
            # row costs half a step, the 1.5B here, every 17 steps); a drafter that costs forwards even less often
            if k == 0 and self._plain_run >= self.probe_interval(cost, catch_up):
                k = 1
            if k == 0:
                continue
            drafts = d.propose(context, k, sampler)[:k]
            if drafts:
                return d, drafts, 0, None
        return None, [], 0, None

    def _draft_lookups(self, lookups: list, context, sampler, limit: int):
        """Every lookup's proposal, each sized by the acceptance of its match class (`lookup_class`); the one
        with the best expected gain, or None if none beats a plain step (but on a probe, one token from the
        first that proposed anything)."""
        best, first = None, None
        for d, drafts, cls, rate in self._lookup_proposals(lookups, context, sampler, limit):
            first = first or (d, drafts[:1], cls, None)
            k, gain = self._best_k_gain(rate, len(drafts))
            if k and (best is None or gain > best[0]):
                best = (gain, (d, drafts[:k], cls, None))
        if best is not None:
            return best[1]
        if first is not None and self._plain_run >= self.probe_interval():
            return first
        return None

    def _lookup_proposals(self, lookups: list, context, sampler, limit: int):
        """(drafter, drafts, match class, its acceptance rate) for each lookup that proposes something."""
        for d in lookups:
            drafts = d.propose(context, limit, sampler)[:limit]
            if drafts:
                cls = lookup_class(d)
                yield d, drafts, cls, self.stats.by_drafter[d.name].rates.get(cls, DrafterStats.rate)

    def _draft_tree(self, d, context, sampler, limit: int, tree_cost: float):
        """The drafter's ranked tree, the lookups' matches grafted on (each token at its match class's
        acceptance), cut to the size that pays (`tree_size`; at least one node on a probe)."""
        toks, parents, scores = d.propose_tree(context, self.max_k, sampler)
        for lk in self.drafters:
            if _is_lookup(lk) and toks:
                chain = lk.propose(context, self.max_k, sampler)[:self.max_k]
                rate = self.stats.by_drafter[lk.name].rates.get(lookup_class(lk), DrafterStats.rate)
                if chain and rate > 0.05:
                    toks, parents, scores = graft(toks, parents, scores, chain, math.log(min(rate, 0.99)))
        n = self.tree_size(scores, parents, limit, tree_cost)
        if n == 0 and toks:
            n = 1  # drafting is spent: verify the likeliest node at least (a row costs less than the tree did)
        if not n:
            return None
        self._tree_pred = sum(math.exp(s) for s in scores[:n])
        return d, toks[:n], 0, parents[:n]

    def _draft_fixed(self, context, sampler, k: int):
        """k drafts from the drafter whose turn it is (or the next that proposes any): a tree of k nodes from a
        drafter that proposes trees."""
        n = len(self.drafters)
        for i in range(n):
            d = self.drafters[(self._turn + i) % n]
            parents = None
            if hasattr(d, "propose_tree"):
                drafts, parents, scores = d.propose_tree(context, k, sampler)
                self._tree_pred = sum(math.exp(s) for s in scores)
            else:
                drafts = d.propose(context, k, sampler)[:k]
            if drafts:
                self._turn = (self._turn + i + 1) % n
                return d, drafts, lookup_class(d), parents
        self._turn = (self._turn + 1) % n
        return None, [], 0, None

    def step(self, tok: int, pos: int, sampler, limit: int) -> list[int]:
        """Emit the tokens after `tok` (at `pos`); `limit` bounds how many this pass may produce."""
        drafter, drafts, cls, parents = self._draft(sampler, min(self.max_k, limit - 1)) if limit > 1 \
            else (None, [], 0, None)
        if drafts and getattr(sampler, "constraint", None) is not None:  # under a grammar, drafts it refuses
            drafts, parents = sampler.cut(drafts, parents)  # are never verified
            if not drafts:
                drafter, cls, parents = None, 0, None
        chain = list(range(len(drafts)))
        tree = None if parents is None or parents == chain else TreeLayout([-1] + parents, pos)
        extra = {"hidden": self.wants_hidden} if self.wants_hidden else {}
        if tree is not None:
            extra["tree"] = tree
        logits = self.engine.forward([tok] + drafts, pos, all_logits=bool(drafts), cache=self.cache, **extra)
        features = None
        if self.wants_hidden:
            logits, features = logits
        return self._accept(drafter, drafts, cls, parents, tree, pos, logits, features, sampler,
                            self.r[len(drafts) + 1])

    def batch_plan(self, sampler, limit: int) -> "DraftPlan":
        """What this generation would draft in a pass it shares with others (`verify_rows`): the lookups' chain
        with the best expected tokens, each draft worth its class's acceptance rate to the power of its depth
        (the pass's owner keeps the prefix of every plan that pays for the rows it adds: `share_rows`). Drafters
        that cost forwards or draft trees draft only in this generation's own passes (`step`). `probe`: its
        plain steps have run long enough that its first draft should be verified whatever it is worth, so that
        the rates a plan is judged by are measured again."""
        if limit < 1 or self.fixed_k is not None:
            return DraftPlan(None, [], 0, [])
        best = None
        lookups = [d for d in self.drafters if _is_lookup(d)]
        for d, drafts, cls, rate in self._lookup_proposals(lookups, sampler.history, sampler, limit):
            if getattr(sampler, "constraint", None) is not None:
                drafts, _ = sampler.cut(drafts, None)
                if not drafts:
                    continue
            values = [rate ** j for j in range(1, len(drafts) + 1)]
            if best is None or sum(values) > sum(best.values):
                best = DraftPlan(d, drafts, cls, values)
        if best is None:
            return DraftPlan(None, [], 0, [])
        best.probe = self._plain_run >= self.probe_interval()
        return best

    def verify_rows(self, plan: "DraftPlan", keep: int, pos: int, logits, features, sampler) -> list[int]:
        """The tokens from a shared pass's rows for this generation: `logits` [1 + keep, V] of its last token and
        the first `keep` drafts of `plan` at `pos` (`features`: those rows' target features, when read). Counted
        as its own pass of 1 + keep rows would be."""
        drafts = plan.drafts[:keep]
        return self._accept(plan.drafter if drafts else None, drafts, plan.cls if drafts else 0, None, None, pos,
                            logits, features, sampler, self.r[min(len(drafts) + 1, len(self.r) - 1)])

    def _accept(self, drafter, drafts, cls, parents, tree, pos, logits, features, sampler, cost: float) -> list[int]:
        """After a pass over [tok] + drafts (a chain, or the tree `tree`): the tokens the target emits, the
        accepted rows moved where plain decoding writes them, the feature readers fed, the statistics kept."""
        chain = list(range(len(drafts)))
        out, path = verify_tree(logits, drafts, chain if parents is None else parents, sampler)
        if tree is not None:
            keep_path(self.cache, pos, path)  # the accepted nodes' rows where plain decoding writes them
        if self.wants_hidden:
            self.observe(pos, features[[0] + path], out)
        if parents is not None:
            self._tree_seen = [0.9 * self._tree_seen[0] + len(path), 0.9 * self._tree_seen[1] + self._tree_pred]
            st = self.stats.by_drafter[drafter.name]
            st.tree_accepted = (1 - self.EMA) * st.tree_accepted + self.EMA * len(path)
            st.tree_nodes = (1 - self.EMA) * st.tree_nodes + self.EMA * len(drafts)
        self.stats.verify_passes += 1
        self.stats.emitted += len(out)
        self.stats.cost += cost
        if drafter is None:
            self.stats.plain_steps += 1
            self._plain_run += 1
        else:
            self._plain_run = 0
            # drafting's cost: a tree its levels, a chain its tokens, each at the drafter's measured cost
            self.stats.draft_cost += _tree_cost(drafter) if parents is not None else \
                getattr(drafter, "cost_per_token", 0.0) * len(drafts)
            accepted = len(out) - 1
            st = self.stats.by_drafter[drafter.name]
            st.passes += 1
            st.drafted += len(drafts)
            st.accepted += accepted
            st.record(cls, accepted, accepted + (1 if accepted < len(drafts) else 0))
        return out


@dataclass
class DraftPlan:
    """A generation's proposal for a shared pass (`SpeculativeStepper.batch_plan`): drafts from `drafter` in its
    match class `cls`, values[j] the expected acceptance of drafts[:j + 1]."""
    drafter: object | None
    drafts: list[int]
    cls: int
    values: list[float]
    probe: bool = False


SHARE_MARGIN = 1.02  # a shared pass drafts only when that beats its plain rows by this factor


def drafts_may_pay(m: int, r: list[float], weights: list[int] | None = None) -> bool:
    """Whether any drafts could pay in a pass shared by m generations: whether some number of extra rows, each
    a draft sure to be accepted, beats the plain rows by SHARE_MARGIN (where none can, as in a pass of ten
    rows bound by the multiplies, asking the drafters would only cost their time). weights: per row's owner the
    generations that take its tokens (best-of-n candidates with the same tokens so far share one set of rows:
    a draft row then earns a token for each; default 1 each); a sure draft row is counted at the largest."""
    w = weights or [1] * m
    total, most = sum(w), max(w, default=0)
    return m > 0 and any((total + n * most) / batch_cost(r, m + n) > SHARE_MARGIN * total / batch_cost(r, m)
                         for n in range(1, len(r) - 1))


def share_rows(plans: list[DraftPlan | None], r: list[float], margin: float = SHARE_MARGIN,
               weights: list[int] | None = None) -> list[int]:
    """How many of each plan's drafts to verify in one pass shared by len(plans) generations (None: one that
    drafts nothing). Every generation's row for its last token is in the pass; each further row is a draft worth
    its value in expected tokens (a chain's values fall with depth, so taking the largest values takes a prefix
    of each chain). The pass keeps the N most valuable drafts, N maximising expected tokens per unit of the
    pass's cost (`batch_cost`), and drafts only if that beats the pass without them by `margin`; a plan marked
    `probe` keeps its first draft however little it is worth. weights: per plan the generations that take its
    rows' tokens (twins, `drafts_may_pay`): its rows' tokens, and its drafts' values, count that many times."""
    m = len(plans)
    w = weights or [1] * m
    if len(w) != m:
        raise ValueError(f"share_rows: {len(w)} weights for {m} plans")
    keep = [1 if p is not None and p.probe and p.drafts else 0 for p in plans]
    rows = m + sum(keep)
    tokens = sum(w) + sum(wi * p.values[0] for p, k, wi in zip(plans, keep, w) if k)
    base = tokens / batch_cost(r, rows)
    ranked = sorted(((w[i] * v, i) for i, (p, k) in enumerate(zip(plans, keep)) if p is not None
                     for v in p.values[k:]), key=lambda t: -t[0])
    best_n, best = 0, base * margin
    for n, (v, _) in enumerate(ranked, start=1):
        tokens += v
        gain = tokens / batch_cost(r, rows + n)
        if gain > best:
            best_n, best = n, gain
    for _, i in ranked[:best_n]:
        keep[i] += 1
    return keep


def batch_cost(r: list[float], rows: int) -> float:
    """The cost of one pass over `rows` rows in 1-token forwards, from the measured r(k) (k <= len(r) - 1;
    beyond, linear in the rows at the largest k's cost per row)."""
    top = len(r) - 1
    return r[min(rows, top)] * max(1.0, rows / top)


def _is_lookup(d) -> bool:
    """A drafter that costs nothing to ask (no forwards of its own: prompt lookup, suffix, grammar)."""
    return getattr(d, "cost_per_token", 0.0) == 0.0


def _tree_cost(d) -> float:
    """What a tree from drafter d costs to draft, in 1-token forwards: one step of the drafter per level."""
    return getattr(d, "cost_per_token", 0.0) * getattr(d, "tree_depth", 1)


class PlainStepper:
    """The standard tier: one token per pass."""

    def __init__(self, engine, cache):
        self.engine, self.cache = engine, cache
        self.stats = SpecStats()

    wants_hidden = False

    def observe(self, start_pos, features, tokens_after):
        pass

    def begin(self, prompt_ids):
        pass

    def end(self, context):
        pass

    def step(self, tok: int, pos: int, sampler, limit: int) -> list[int]:
        logits = self.engine.forward([tok], pos, cache=self.cache)
        self.stats.record_plain()
        return [sampler.sample(logits[-1])]
