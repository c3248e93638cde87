"""`ultrafast acceptance`: how often each drafter is right on the target's own text, depth by depth.

The target answers every question greedily (the standard tier's output at temperature 0), in batched one-row
passes that give each answer bit for bit as it would come alone (`training.features.continue_greedily`), and
keeps its last-layer features. Then, at every position of every answer (or every `stride`-th), each drafter
is asked what follows the text so far, as the ultrafast tier would ask it: a chain of up to `depth` tokens
(prompt lookup, suffix decoding, the draft head) and, for the head, a token tree of up to `nodes` nodes
(EAGLE-2's dynamic tree; every prefix of its ranking is the tree for a smaller budget). A draft is accepted up
to its first token that differs from the target's own continuation, as greedy verification accepts it.
`joined` is the tree the tier verifies when every drafter proposes at once (the lookups' chains and the head's
largest tree under one root): at each position the longest of their accepted lengths.

Per drafter: the share of positions where it proposed anything; the acceptance at each depth (accepted at d
given accepted up to d-1; no proposal is a miss at depth 1); and tau(k) = 1 + the mean accepted length of a
chain of at most k drafts (the tokens one pass that verifies them would emit), or of a tree of k nodes. These
are per position and need no timing: what a drafter could earn, before the policy decides what to verify.
The suffix drafter's history holds the earlier questions' prompts and answers, in order, as in a server.

Per-position tau weighs every position alike; the tier does not: a pass that accepts n drafts skips the next n
positions, and those are mostly where drafts are right (inside a repeated span). `walked` walks each answer as
the tier would with one drafter (at stride 1): a pass verifies its proposal (a chain cut to k, a tree whole),
emits the accepted tokens and the bonus, and the next pass starts after them. Its tau(k) is tokens per pass,
and drafts(k) the draft rows each pass verified on average (the forward has one more): the figures to set
against the measured cost r(1 + drafts) of a pass.
"""

from __future__ import annotations

import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import torch

from .. import report
from ..report import Progress

LOOKUPS = ("prompt_lookup", "suffix")
JOINED = "joined"  # one tree holding every drafter's proposal (the lookups' chains and the head's largest tree)


class Tally:
    """Accepted lengths of one drafter's proposals: acceptance per depth and tau per chain length."""

    def __init__(self, depth: int):
        self.depth = depth
        self.positions = self.proposed = 0
        self.hist = [0] * (depth + 1)  # positions by accepted length 0..depth

    def add(self, proposal_len: int, accepted: int) -> None:
        self.positions += 1
        self.proposed += proposal_len > 0
        self.hist[min(accepted, self.depth)] += 1

    def summary(self) -> dict:
        n = max(self.positions, 1)
        reached = [sum(self.hist[a:]) for a in range(self.depth + 1)]  # positions with accepted length >= a
        acc = [reached[d] / reached[d - 1] if reached[d - 1] else 0.0 for d in range(1, self.depth + 1)]
        tau = [1.0 + sum(reached[1:k + 1]) / n for k in range(1, self.depth + 1)]
        return {"positions": self.positions, "proposed": round(self.proposed / n, 4),
                "acceptance_by_depth": [round(a, 4) for a in acc], "tau_by_length": [round(t, 3) for t in tau]}


class Walk:
    """One drafter's answers walked as the tier walks them (module docstring): tokens, passes and draft rows
    per chain length."""

    def __init__(self, depth: int):
        self.depth = depth
        self.tokens, self.passes, self.drafts = [0] * depth, [0] * depth, [0] * depth

    def add(self, steps: list[tuple[list[int], int]]) -> None:
        """steps: at each position of one answer, in order, (draft rows verified at chain length 1..depth, the
        accepted length)."""
        for k in range(1, self.depth + 1):
            p = 0
            while p < len(steps):
                rows, accepted = steps[p]
                a = min(accepted, k)
                self.tokens[k - 1] += a + 1
                self.passes[k - 1] += 1
                self.drafts[k - 1] += rows[k - 1]
                p += a + 1

    def summary(self) -> dict:
        return {"tau_by_length": [round(t / max(n, 1), 3) for t, n in zip(self.tokens, self.passes)],
                "drafts_by_length": [round(r / max(n, 1), 2) for r, n in zip(self.drafts, self.passes)]}


def draft_rows(name: str, got: dict, k: int, joined: list[str], trees: frozenset[str]) -> int:
    """The draft rows a pass verifies for this drafter's proposal at chain length k: a chain cut to k, a tree
    (a name in `trees`) whole, the joined tree its parts."""
    if name == JOINED:
        return sum(draft_rows(n, got, k, joined, trees) for n in joined)
    return got[name][0] if name in trees else min(got[name][0], k)


def chain_accepted(proposal: list[int], truth: list[int]) -> int:
    n = 0
    for a, b in zip(proposal, truth):
        if a != b:
            break
        n += 1
    return n


def tree_accepted(tokens: list[int], parents: list[int], truth: list[int], n_nodes: int) -> int:
    """The longest root path among the first n_nodes nodes (numbered from 1, parent 0 = root) that the truth
    follows."""
    children = defaultdict(dict)
    for i in range(min(n_nodes, len(tokens))):
        children[parents[i]].setdefault(tokens[i], i + 1)
    node, n = 0, 0
    for t in truth:
        node = children[node].get(t)
        if node is None:
            break
        n += 1
    return n


def measure(engine, prompts: list[list[int]], *, max_tokens: int, depth: int = 5, nodes: tuple[int, ...] = (4, 8, 16),
            stride: int = 1, batch: int = 16, labels: list[str] | None = None, progress_file=sys.stderr) -> dict:
    """The figures of the module docstring for these prompts (token ids); labels: a category per prompt, for
    per-category tau. Returns {"overall": {drafter: summary}, "by_label": {label: {drafter: tau}}, ...}."""
    from ..drafters.prompt_lookup import PromptLookupDrafter
    from ..drafters.suffix import SuffixCache, SuffixDrafter
    from ..training.features import continue_greedily

    if depth < 1 or stride < 1 or batch < 1 or max_tokens < 2:
        raise ValueError("depth, stride and batch must be at least 1, max-tokens at least 2")
    if not nodes or any(n < 1 for n in nodes):
        raise ValueError("tree node budgets must be at least 1 (at least one budget)")
    answers = {}
    with Progress(sum(map(len, prompts)) + max_tokens * len(prompts), "greedy answers", "tok",
                  file=progress_file) as bar:
        for i, result in continue_greedily(engine, enumerate(prompts), engine.max_context, batch, bar.update,
                                           new_tokens=max_tokens, prompt_labels=False,
                                           layers=engine.draft_head.config.extra_layers if engine.draft_head else ()):
            answers[i] = result
    head = engine.draft_head
    tree_names = [f"head tree {n}" for n in nodes] if head is not None else []
    trees = frozenset(tree_names)
    names = [*LOOKUPS, *(["head", *tree_names] if head is not None else []), JOINED]
    joined = [*LOOKUPS] + ([f"head tree {max(nodes)}"] if head is not None else [])
    tallies = {n: Tally(depth) for n in names}
    walks = {n: Walk(depth) for n in names}
    by_label = defaultdict(lambda: {n: Tally(depth) for n in names})
    suffix_cache = SuffixCache()
    lookups = {"prompt_lookup": PromptLookupDrafter(), "suffix": SuffixDrafter(suffix_cache)}
    total_positions = sum(max(0, (answers[i][0].numel() - len(p) - depth + 1 + stride - 1) // stride)
                          for i, p in enumerate(prompts))
    generated, done, interrupted = 0, 0, False
    with Progress(total_positions, "drafting at each position", "pos", file=progress_file) as bar:
        try:
            for i, prompt in enumerate(prompts):
                tokens_t, feats, greedy = answers[i]
                truth_all = tokens_t.tolist() + [int(greedy[-1])]  # the answer and its last token (not fed)
                rows = _draft_answer(engine, head, lookups, prompt, truth_all, feats, depth=depth, nodes=nodes,
                                     stride=stride, joined=joined, bar=bar)
                for got in rows:  # a question counts whole or not at all
                    for name, (n_prop, acc) in got.items():
                        tallies[name].add(n_prop, acc)
                        by_label[labels[i] if labels else "all"][name].add(n_prop, acc)
                if stride == 1:
                    for name, w in walks.items():
                        w.add([([draft_rows(name, got, k, joined, trees) for k in range(1, depth + 1)], got[name][1])
                               for got in rows])
                generated += len(truth_all) - len(prompt)
                done += 1
                suffix_cache.add(truth_all)  # what a server keeps of a finished request: prompt and answer
        except KeyboardInterrupt:  # Ctrl-C: the figures of the questions finished so far
            interrupted = True
    return {"overall": {n: t.summary() for n, t in tallies.items()},
            "walked": {n: w.summary() for n, w in walks.items()} if stride == 1 else None,
            "by_label": {lab: {n: t.summary()["tau_by_length"][-1] for n, t in ts.items()}
                         for lab, ts in by_label.items()},
            "questions": done, "interrupted": interrupted, "generated_tokens": generated, "depth": depth,
            "stride": stride, "nodes": list(nodes)}


def _draft_answer(engine, head, lookups: dict, prompt: list[int], truth_all: list[int], feats, *, depth: int,
                  nodes: tuple[int, ...], stride: int, joined: list[str], bar) -> list[dict]:
    """Every drafter asked at every stride-th position of one answer: a {drafter: (proposed, accepted)} per
    position."""
    from ..drafters.head import HeadDrafter

    tokens = truth_all[:-1]  # what the target was fed
    P = len(prompt)
    for d in lookups.values():
        d.begin(prompt)
    drafter = None
    if head is not None:
        drafter = HeadDrafter(engine, head, 0.0, len(tokens) + 128)
        drafter.begin(prompt)
        drafter.observe(0, feats[:P], tokens[1:P + 1])  # the prefill's rows, as the stepper hands them
    rows = []
    p = P + 1  # the first draft follows the first generated token
    while p + depth <= len(truth_all):
        context, truth = tokens[:p], truth_all[p:p + depth]
        got = {}
        for name, d in lookups.items():
            prop = d.propose(context, depth)
            got[name] = (len(prop), chain_accepted(prop, truth))
        if drafter is not None:
            prop = drafter.propose(context, depth)
            got["head"] = (len(prop), chain_accepted(prop, truth))
            toks, parents, _ = drafter.propose_tree(context, max(nodes))
            for n in nodes:
                got[f"head tree {n}"] = (min(n, len(toks)), tree_accepted(toks, parents, truth, n))
        got[JOINED] = (sum(got[n][0] for n in joined), max(got[n][1] for n in joined))
        rows.append(got)
        step = min(stride, len(truth_all) - depth - p + 1)
        if drafter is not None:  # the target's rows up to the next position, as after an accepted pass
            drafter.observe(p - 1, feats[p - 1:p - 1 + step], tokens[p:p + step])
        p += step
        bar.update(1)
    return rows


def format_table(result: dict, title: str) -> str:
    depth = result["depth"]
    head = (f"| drafter | proposed | " + " | ".join(f"acc d{d}" for d in range(1, depth + 1)) + " | "
            + " | ".join(f"tau({k})" for k in range(1, depth + 1)) + " |")
    lines = [title, "", head, "|" + "---|" * (2 + 2 * depth)]
    for name, s in result["overall"].items():
        cells = [f"{a:.2f}" for a in s["acceptance_by_depth"]] + [f"{t:.2f}" for t in s["tau_by_length"]]
        lines.append(f"| {name} | {s['proposed']:.0%} | " + " | ".join(cells) + " |")
    if result.get("walked"):
        lines += ["", "walked as the tier walks it: tokens per pass tau(k), draft rows verified per pass drafts(k):",
                  "", "| drafter | " + " | ".join(f"tau({k})" for k in range(1, depth + 1)) + " | "
                  + " | ".join(f"drafts({k})" for k in range(1, depth + 1)) + " |", "|" + "---|" * (1 + 2 * depth)]
        for name, w in result["walked"].items():
            lines.append(f"| {name} | " + " | ".join(f"{t:.2f}" for t in w["tau_by_length"]) + " | "
                         + " | ".join(f"{r:.2f}" for r in w["drafts_by_length"]) + " |")
    lines += ["", "tau per category (the longest chain; a tree: its whole budget):", ""]
    names = list(result["overall"])
    lines += ["| category | " + " | ".join(names) + " |", "|" + "---|" * (1 + len(names))]
    for lab, taus in result["by_label"].items():
        lines.append(f"| {lab} | " + " | ".join(f"{taus[n]:.2f}" for n in names) + " |")
    return "\n".join(lines)


def plot(result: dict, title: str, path: Path) -> None:
    """Acceptance per depth, a line per drafter; tau per chain length (trees: their budget's tau), per position
    and (dashed) per pass as the tier walks."""
    with report.figure(path, ncols=2, size=(10.0, 4.2)) as (fig, (ax1, ax2)):
        depths = list(range(1, result["depth"] + 1))
        walked = result.get("walked") or {}
        for name, s in result["overall"].items():
            ax1.plot(depths, s["acceptance_by_depth"], marker="o", label=name)
            (line,) = ax2.plot(depths, s["tau_by_length"], marker="o", label=name)
            if name in walked:  # dashed: tokens per pass, walked as the tier walks
                ax2.plot(depths, walked[name]["tau_by_length"], linestyle="--", color=line.get_color())
        ax1.set(xlabel="depth", ylabel="accepted (given the depths before)", ylim=(0, 1), xticks=depths)
        ax2.set(xlabel="chain length (trees: depth reached)", ylabel="tau (dashed: per pass, walked)",
                xticks=depths)
        ax1.legend(fontsize=8)
        fig.suptitle(textwrap.fill(title, 130), fontsize=8)


def main(args) -> int:
    from ..engine import Engine
    from .spec_bench import default_questions_path, load_questions

    torch.set_num_threads(args.threads)
    engine = Engine.from_model(args.model, max_context=args.max_context, draft_head=args.draft_head)
    nodes = tuple(int(n) for n in args.nodes.split(",") if n.strip())
    questions = load_questions(Path(args.questions) if args.questions else default_questions_path(),
                               None if args.all else args.per_category)
    prompts = [engine.chat_prompt([{"role": "user", "content": q}]) for _, q in questions]
    for p in prompts:
        engine.check_prompt(p)
    result = measure(engine, prompts, max_tokens=args.max_tokens, depth=args.depth, nodes=nodes,
                     stride=args.stride, batch=args.batch, labels=[c for c, _ in questions])
    head = engine.draft_head
    result["draft_head"] = head.meta["path"] if head is not None else None
    asked = (f"{result['questions']} (interrupted: the first {result['questions']} of {len(questions)})"
             if result["interrupted"] else f"{len(questions)}")
    title = (f"Drafter acceptance on {engine.loaded.path.name}'s greedy answers to {asked} Spec-Bench first "
             f"turns ({result['generated_tokens']} tokens, up to {args.max_tokens} each), at every "
             + (f"{args.stride}th " if args.stride > 1 else "") + "position"
             + (f"; draft head {Path(head.meta['path']).name}" if head is not None else "; no draft head"))
    print(format_table(result, title))
    report.write(args.json, {"title": title, **result}, lambda png: plot(result, title, png))
    return 0
