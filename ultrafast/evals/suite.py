"""`ultrafast evals suite`: a question set run to completion in each tier through the server, with the
concurrency an agent harness would use, greedy: the wall-clock per tier and their ratio, tokens in and out, and
what the run cost at each tier's price (the server's own ledger, `/v1/usage`, before and after).

Sets: Spec-Bench's 480 first turns (`../shared/data/spec_bench/question.jsonl`), HumanEval's 164 prompts, and
`agent`: the agent loop's edits (`ultrafast agentbench`'s file and its six tasks, each sent as its first edit),
agents at work side by side, each asking for its whole file back.
Each request's record is appended to a JSON-lines file as it completes (Ctrl-C keeps them).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import report

SETS = ("specbench", "humaneval", "agent")


def prompts(name: str, limit: int | None, questions: str | None, per_category: int | None = None) -> list[list[dict]]:
    """A set's chat messages, in order (Spec-Bench: the first `per_category` of each category, if given)."""
    if name == "specbench":
        from ..benchmarks.spec_bench import default_questions_path, load_questions

        qs = load_questions(Path(questions) if questions else default_questions_path(), per_category)
        out = [[{"role": "user", "content": text}] for _, text in qs]
    elif name == "humaneval":
        from .humaneval import load_problems, messages

        out = [messages(p) for p in load_problems()]
    elif name == "agent":
        from ..benchmarks.agent_loop import START_FILE, TASKS, edit_messages

        out = [edit_messages(START_FILE, task) for task in TASKS]
    else:
        raise ValueError(f"unknown set {name!r}: one of {', '.join(SETS)}")
    return out[:limit] if limit else out


@dataclass
class TierRun:
    set: str
    tier: str
    requests: int
    wall_clock_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float  # the ledger's spend over the run


def _spend(http, tier: str) -> float:
    rows = http.get("/v1/usage").json()["data"]
    return sum(r["cost_usd"] for r in rows if r["tier"] == tier)


async def _run(base_url: str, api_key: str, model: str, name: str, msgs: list, tier: str, concurrency: int,
               max_tokens: int, records, bar) -> tuple[float, list]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=3600)
    sem = asyncio.Semaphore(concurrency)
    usages = []
    # this tier's run reuses only its own prompts' KV rows, never those the other tier's run left in the slots
    # (the agent set's six prompts fit six slots: the second tier found them all cached)
    salt = f"suite-{tier}-{uuid.uuid4().hex}"

    async def one(i: int, m: list[dict]):
        async with sem:
            t0 = time.perf_counter()
            r = await client.chat.completions.create(model=model, messages=m, temperature=0, max_tokens=max_tokens,
                                                     service_tier=tier, extra_body={"cache_salt": salt})
            u = r.usage
            cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
            usages.append((u.prompt_tokens, cached or 0, u.completion_tokens))
            records.write(json.dumps({"set": name, "tier": tier, "index": i, "seconds": time.perf_counter() - t0,
                                      "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                                      "text": r.choices[0].message.content}) + "\n")
            records.flush()
            bar.update(1)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(i, m) for i, m in enumerate(msgs)))
    finally:
        await client.close()
    return time.perf_counter() - t0, usages


def run(args) -> int:
    import httpx

    from .server_process import check_args, served

    check_args(args)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    for s in sets:
        if s not in SETS:
            raise ValueError(f"--sets: unknown set {s!r}: one of {', '.join(SETS)}")
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.per_category is not None and args.per_category < 1:
        raise ValueError(f"--per-category must be at least 1, got {args.per_category}")
    tiers = ["standard", "ultrafast"] if args.tier == "both" else [args.tier]
    work = {s: prompts(s, args.limit, args.questions, args.per_category) for s in sets}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[TierRun] = []
    key = args.api_key or "local"
    with served(args, slots=max(args.concurrency, 4)) as (base_url, model), out.open("a") as records:
        http = httpx.Client(base_url=base_url[:-3], headers={"Authorization": f"Bearer {key}"}, timeout=60)
        try:
            for name, msgs in work.items():
                for tier in tiers:
                    before = _spend(http, tier)
                    with report.Progress(len(msgs), f"{name} {tier}", "req") as bar:
                        wall, usages = asyncio.run(_run(base_url, key, model, name, msgs, tier, args.concurrency,
                                                        args.max_tokens, records, bar))
                    runs.append(TierRun(name, tier, len(usages), wall, sum(u[0] for u in usages),
                                        sum(u[1] for u in usages), sum(u[2] for u in usages),
                                        _spend(http, tier) - before))
        except KeyboardInterrupt:
            print("interrupted: the runs completed so far", file=sys.stderr)
        finally:
            http.close()
            _report(runs, args)
    return 0


def _report(runs: list[TierRun], args) -> None:
    if not runs:
        return
    print(f"\n| set | tier | requests | wall-clock (s) | prompt tokens (cached) | completion tokens | cost ($) |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r.set} | {r.tier} | {r.requests} | {r.wall_clock_s:.1f} | {r.prompt_tokens} ({r.cached_tokens}) | "
              f"{r.completion_tokens} | {r.cost_usd:.6f} |")
    by = {(r.set, r.tier): r for r in runs}
    for s in dict.fromkeys(r.set for r in runs):
        a, b = by.get((s, "standard")), by.get((s, "ultrafast"))
        if a and b and a.requests == b.requests:
            print(f"{s}: standard / ultrafast wall-clock = {a.wall_clock_s / b.wall_clock_s:.2f}x at concurrency "
                  f"{args.concurrency}; the ultrafast run cost {b.cost_usd / a.cost_usd if a.cost_usd else 0:.1f}x")
    report.write(args.json, [asdict(x) for x in runs], lambda png: plot(runs, png))


def plot(runs: list[TierRun], path: Path) -> None:
    """Wall-clock per set, a bar per tier."""
    sets = list(dict.fromkeys(r.set for r in runs))
    width = 0.38
    with report.figure(path, size=(6.4, 4.0)) as (fig, ax):
        for j, tier in enumerate(("standard", "ultrafast")):
            xs = [i + (j - 0.5) * width for i, s in enumerate(sets)
                  if any(r.set == s and r.tier == tier for r in runs)]
            ys = [r.wall_clock_s for s in sets for r in runs if r.set == s and r.tier == tier]
            ax.bar(xs, ys, width, label=tier, color=report.TIER_COLOURS[tier])
        ax.set_xticks(range(len(sets)), [f"{s} ({max(r.requests for r in runs if r.set == s)})" for s in sets])
        ax.set_ylabel("wall-clock (s)")
        ax.set_title("A suite run to completion, per tier")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
