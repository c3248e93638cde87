"""`ultrafast agentbench`: a coding agent asked again and again to change the same file, re-sending the
whole file each time and getting the whole file back, as agents do. Both tiers run the same loop (greedy,
so they see the same files), edit by edit: each edit is made by the standard tier and then by the ultrafast
tier, so that both meet the host in the same minute (its memory bandwidth moves from minute to minute, and the
standard tier's speed with it); per iteration and in total it prints tokens/s of each tier, the speedup and
tau. This is the workload prompt lookup and suffix decoding are for: most of every answer is text the model
has already seen (in the prompt) or written (in earlier iterations).
"""

from __future__ import annotations

import sys

from .. import report
from ..report import Progress
from ..sampler import SamplingParams
from . import ceiling_line, drafters_line, sum_drafters, tier_engine

SYSTEM = ("You are a coding agent. You edit the user's file as asked and reply with the complete updated file "
          "in one ```python block, nothing else.")

START_FILE = '''import json
from pathlib import Path


def load_users(path):
    with open(path) as f:
        data = json.load(f)
    return [u for u in data if u.get("active")]


def count_by_country(users):
    counts = {}
    for u in users:
        c = u["country"]
        counts[c] = counts.get(c, 0) + 1
    return counts


def top_countries(users, n):
    counts = count_by_country(users)
    return sorted(counts.items(), key=lambda kv: kv[1], reverse=True)[:n]


def save_report(users, out):
    report = {"total": len(users), "top": top_countries(users, 3)}
    Path(out).write_text(json.dumps(report, indent=2))
'''

TASKS = [
    "Rename the function `load_users` to `read_active_users` everywhere.",
    "Add a docstring to `count_by_country`.",
    "Add type hints to `top_countries`.",
    "Make `save_report` also include the number of countries under the key \"countries\".",
    "Use collections.Counter in `count_by_country`.",
    "Add a `main()` function that loads users.json and saves report.json, and call it under `if __name__ == \"__main__\":`.",
]


def edit_messages(file: str, task: str) -> list[dict]:
    """The chat an agent sends for one edit: the whole file, and what to change."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Here is my file:\n```python\n{file}```\n\n{task}"}]


def extract_file(text: str, previous: str) -> str:
    if "```" not in text:
        return previous
    body = text.split("```", 1)[1]
    body = body.split("\n", 1)[1] if "\n" in body else body
    return body.split("```", 1)[0]


def run_agent_loop(engine, *, iterations: int, max_tokens: int, drafters=None, progress=sys.stderr):
    """(standard results, ultrafast results): per iteration the standard tier's edit, then the ultrafast tier's
    of its own current file (the same file while both tiers emit the same tokens)."""
    current = {"standard": START_FILE, "ultrafast": START_FILE}
    rows: dict[str, list] = {"standard": [], "ultrafast": []}
    bar = Progress(iterations, "agent loop, standard then ultrafast", "edit", file=progress)
    for i in range(iterations):
        task = TASKS[i % len(TASKS)]
        for tier in ("standard", "ultrafast"):
            ids = engine.chat_prompt(edit_messages(current[tier], task))
            engine.cache.tokens = []  # the agent's prompt changes every time; no help from the KV cache here
            res = engine.generate(ids, SamplingParams(max_tokens=max_tokens), tier=tier,
                                  drafters=drafters if tier == "ultrafast" else None)
            rows[tier].append(res)
            current[tier] = extract_file(res.text, current[tier])
            bar.note(f"  {tier} iteration {i + 1}: {len(res.token_ids)} tokens, {res.decode_tokens_per_s:.1f} tok/s, "
                     f"tau {res.spec.get('tau', 1):.2f}")
        bar.update(1)
    bar.close()
    return rows["standard"], rows["ultrafast"]


def main(args) -> int:
    engine, drafters = tier_engine(args)
    std, fast = run_agent_loop(engine, iterations=args.iterations, max_tokens=args.max_tokens, drafters=drafters)
    print(f"agent loop on {engine.loaded.path.name}: {args.iterations} edits of one file, greedy, {args.threads} "
          f"threads, {args.activation_bits}-bit activations, drafters {','.join(drafters or engine.default_drafters)}")
    print(f"{'iter':>4}{'tokens':>8}{'standard':>10}{'ultrafast':>11}{'speedup':>9}{'tau':>7}  same output")
    exact = True
    for i, (a, b) in enumerate(zip(std, fast)):
        same = a.token_ids == b.token_ids
        exact &= same
        print(f"{i + 1:4d}{len(a.token_ids):8d}{a.decode_tokens_per_s:10.1f}{b.decode_tokens_per_s:11.1f}"
              f"{b.decode_tokens_per_s / a.decode_tokens_per_s:8.2f}x{b.spec['tau']:7.2f}  {'yes' if same else 'NO'}")
    n = sum(len(a.token_ids) - 1 for a in std)
    ts, tf = sum(a.decode_s for a in std), sum(b.decode_s for b in fast)
    print(f"total: standard {n / ts:.1f} tok/s, ultrafast {n / tf:.1f} tok/s, speedup {ts / tf:.2f}x; "
          f"identical outputs: {'yes' if exact else 'NO'}")
    print(drafters_line(sum_drafters([b.spec for b in fast])))
    print(ceiling_line(engine.r_table))
    figures = {"model": engine.loaded.path.name, "iterations": [
        {"tokens": len(a.token_ids), "standard_tok_s": a.decode_tokens_per_s, "ultrafast_tok_s": b.decode_tokens_per_s,
         "tau": b.spec["tau"], "identical": a.token_ids == b.token_ids} for a, b in zip(std, fast)],
        "standard_tok_s": n / ts, "ultrafast_tok_s": n / tf, "speedup": ts / tf, "identical": exact}
    report.write(args.json, figures, lambda png: plot(figures, png))
    return 0 if exact else 1


def plot(figures: dict, path) -> None:
    """Decode tokens/s per edit of the file, a line per tier, tau over the ultrafast points."""
    its = figures["iterations"]
    xs = range(1, len(its) + 1)
    with report.figure(path) as (fig, ax):
        for tier in ("standard", "ultrafast"):
            ax.plot(xs, [r[f"{tier}_tok_s"] for r in its], "o-", label=f"{tier} ({figures[f'{tier}_tok_s']:.1f} "
                    "tok/s overall)", color=report.TIER_COLOURS[tier])
        for x, r in zip(xs, its):
            ax.annotate(f"tau {r['tau']:.1f}", (x, r["ultrafast_tok_s"]), fontsize=7, textcoords="offset points",
                        xytext=(-10, 6))
        ax.set_xlabel("edit (the whole file re-sent and returned each time)")
        ax.set_ylabel("decode tokens/s (batch 1)")
        ax.set_title(f"Agent loop on {figures['model']}: {figures['speedup']:.2f}x", fontsize=10)
        ax.set_ylim(0, None)
        ax.margins(y=0.15)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
