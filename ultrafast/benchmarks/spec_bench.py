"""`ultrafast specbench`: Spec-Bench (first turns, greedy, batch 1) in both tiers in one invocation.

Per category: decode tokens/s of each tier, the speedup, tau (tokens per pass over the weights) and the
mean r(k) of the verify passes; every ultrafast output is checked token for token against the standard
tier's (a mismatch is reported and makes the command exit non-zero). Where llama-cpp-python is
installed, llama.cpp's plain decoding and its prompt-lookup speculation run the same prompts.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from .. import report
from ..report import Progress
from ..sampler import SamplingParams
from . import ceiling_line, drafters_line, sum_drafters, tier_engine

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
CATEGORIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]


def default_questions_path() -> Path:
    here = Path(__file__).resolve()
    for base in [Path.cwd(), *here.parents]:
        p = base / ".." / "shared" / "data" / "spec_bench" / "question.jsonl"
        if p.exists():
            return p.resolve()
    return Path("../shared/data/spec_bench/question.jsonl")


def load_questions(path: Path, per_category: int | None) -> list[tuple[str, str]]:
    """(category, first turn) pairs; MT-Bench's eight sub-categories count as one category, as Spec-Bench does."""
    if not path.exists():
        raise ValueError(f"{path}: Spec-Bench questions not found (pass --questions)")
    seen, out = defaultdict(int), []
    for line in path.read_text().splitlines():
        q = json.loads(line)
        cat = "mt_bench" if q["category"] in MT_BENCH else q["category"]
        if per_category is None or seen[cat] < per_category:
            seen[cat] += 1
            out.append((cat, q["turns"][0]))
    return out


def _llama_runner(path, threads: int, n_ctx: int):
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None

    plain = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    pld = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
                logits_all=True, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=8))

    def run(llm, ids, n):
        llm.reset()
        out, t1 = [], None
        for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            if t1 is None:
                t1 = time.perf_counter()
            out.append(tok)
            if len(out) >= n:
                break
        return out, (len(out) - 1) / (time.perf_counter() - t1) if len(out) > 1 else 0.0
    return lambda ids, n: (run(plain, ids, n), run(pld, ids, n))


def run_spec_bench(engine, questions, *, max_tokens: int = 128, drafters=None, llama=None, progress=sys.stderr):
    """llama: a callable that builds the llama.cpp runner; it runs after ours, so that its thread pool (which
    spins while idle) never shares the cores with our measurements."""
    rows = defaultdict(lambda: defaultdict(float))
    specs = []  # the ultrafast runs' reports
    mismatches, prompts = [], []
    bar = Progress(len(questions), "Spec-Bench, both tiers", "question", file=progress)
    for i, (cat, text) in enumerate(questions):
        ids = engine.chat_prompt([{"role": "user", "content": text}])
        params = SamplingParams(max_tokens=max_tokens)
        results = {}
        for tier in ("standard", "ultrafast"):
            engine.cache.tokens = []  # both tiers prefill from scratch
            results[tier] = engine.generate(ids, params, tier=tier, drafters=drafters)
        std, fast = results["standard"], results["ultrafast"]
        if std.token_ids != fast.token_ids:
            mismatches.append((cat, text[:60]))
        r = rows[cat]
        r["n"] += 1
        r["tokens"] += len(std.token_ids) - 1
        r["std_s"] += std.decode_s
        r["fast_s"] += fast.decode_s
        r["passes"] += fast.spec["verify_passes"]
        r["emitted"] += fast.spec["verify_passes"] * fast.spec["tau"]
        r["rk"] += fast.spec.get("mean_r", 1.0) * fast.spec["verify_passes"]
        specs.append(fast.spec)
        prompts.append((cat, ids))
        bar.note(f"[{i + 1}/{len(questions)}] {cat}: standard {std.decode_tokens_per_s:.1f} tok/s, ultrafast "
                 f"{fast.decode_tokens_per_s:.1f} tok/s, tau {fast.spec['tau']:.2f}"
                 + ("" if std.token_ids == fast.token_ids else "  MISMATCH"))
        bar.update(1, tau=f"{fast.spec['tau']:.2f}")
    bar.close()
    runner = llama() if llama is not None else None
    if runner:
        with Progress(len(prompts), "llama.cpp", "question", file=progress) as bar:
            for i, (cat, ids) in enumerate(prompts):
                (_, lc_plain), (_, lc_pld) = runner(ids, max_tokens)
                rows[cat]["lc_plain"] += lc_plain
                rows[cat]["lc_pld"] += lc_pld
                bar.note(f"[{i + 1}/{len(prompts)}] llama.cpp {cat}: plain {lc_plain:.1f} tok/s, prompt lookup "
                         f"{lc_pld:.1f}")
                bar.update(1)
    llama = runner
    table = {}
    for cat in CATEGORIES + sorted(set(rows) - set(CATEGORIES)):
        if cat not in rows:
            continue
        r = rows[cat]
        std_tps, fast_tps = r["tokens"] / r["std_s"], r["tokens"] / r["fast_s"]
        table[cat] = {
            "questions": int(r["n"]), "standard_tok_s": std_tps, "ultrafast_tok_s": fast_tps,
            "speedup": fast_tps / std_tps, "tau": r["emitted"] / r["passes"], "mean_r_k": r["rk"] / r["passes"],
            "llama_cpp_tok_s": r["lc_plain"] / r["n"] if llama else None,
            "llama_cpp_pld_tok_s": r["lc_pld"] / r["n"] if llama else None,
        }
    speedups = [v["speedup"] for v in table.values()]
    summary = {"mean_speedup": sum(speedups) / len(speedups), "min_speedup": min(speedups),
               "mean_tau": sum(v["tau"] for v in table.values()) / len(table),
               "exact": not mismatches, "mismatches": mismatches,
               "drafters": sum_drafters(specs)}
    return table, summary


def format_table(table, summary, title) -> str:
    lines = [title, f"{'category':16}{'n':>4}{'standard':>10}{'ultrafast':>11}{'speedup':>9}{'tau':>7}{'r(k)':>7}"
             f"{'llama.cpp':>11}{'lc-PLD':>9}"]
    for cat, v in table.items():
        lc = f"{v['llama_cpp_tok_s']:11.1f}{v['llama_cpp_pld_tok_s']:9.1f}" if v["llama_cpp_tok_s"] else f"{'-':>11}{'-':>9}"
        lines.append(f"{cat:16}{v['questions']:4d}{v['standard_tok_s']:10.1f}{v['ultrafast_tok_s']:11.1f}"
                     f"{v['speedup']:8.2f}x{v['tau']:7.2f}{v['mean_r_k']:7.2f}{lc}")
    lines.append(f"mean speedup {summary['mean_speedup']:.2f}x, lowest {summary['min_speedup']:.2f}x, mean tau "
                 f"{summary['mean_tau']:.2f}; ultrafast output identical to standard: "
                 f"{'yes' if summary['exact'] else 'NO: ' + str(len(summary['mismatches'])) + ' prompts differ'}")
    if summary.get("drafters"):
        lines.append(drafters_line(summary["drafters"]))
    return "\n".join(lines)


def main(args) -> int:
    engine, drafters = tier_engine(args)
    engine.fixed_draft_k = args.fixed_k
    path = engine.loaded.path
    questions = load_questions(Path(args.questions) if args.questions else default_questions_path(),
                               None if args.all else args.per_category)
    llama = None if args.no_llama_cpp else (lambda: _llama_runner(path, args.threads, args.max_context))
    table, summary = run_spec_bench(engine, questions, max_tokens=args.max_tokens, drafters=drafters, llama=llama)
    title = (f"Spec-Bench on {path.name}: {len(questions)} first turns, greedy, {args.max_tokens} new tokens, "
             f"batch 1, {args.threads} threads, {args.activation_bits}-bit activations, drafters "
             f"{','.join(drafters or engine.default_drafters)}"
             + (f", fixed k = {args.fixed_k} (no policy: an exactness check)" if args.fixed_k else "")
             + "; decode tok/s")
    print(format_table(table, summary, title))
    print(ceiling_line(engine.r_table))
    head = engine.draft_head
    if head is not None:
        print(f"draft head {head.meta['path']}: {head.nbytes_per_token() / 1e6:.1f} MB of weights per draft token, "
              f"{engine.head_cost:.3f} of a target step per draft token, {engine.head_upkeep:.3f} per row the target "
              f"keeps (the head's cache, paid when it drafts) (measured)" if engine.head_cost is not None
              else f"draft head {head.meta['path']}: not used by these drafters")
    report.write(args.json, {"title": title, "table": table, "summary": summary},
                 lambda png: plot(table, f"Spec-Bench on {path.name}: {len(questions)} first turns, greedy", png))
    return 0 if summary["exact"] else 1


def plot(table: dict, title: str, path: Path) -> None:
    """Decode tokens/s per category, a bar per tier (and llama.cpp's where it ran), tau over each category."""
    cats = list(table)
    series = [("standard", "standard_tok_s"), ("ultrafast", "ultrafast_tok_s")]
    if any(v.get("llama_cpp_tok_s") for v in table.values()):
        series.append(("llama.cpp", "llama_cpp_tok_s"))
    width = 0.8 / len(series)
    with report.figure(path, size=(8.0, 4.4)) as (fig, ax):
        for j, (name, key) in enumerate(series):
            xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(cats))]
            ax.bar(xs, [table[c][key] or 0 for c in cats], width, label=name, color=report.TIER_COLOURS[name])
        for i, c in enumerate(cats):
            top = max(table[c][key] or 0 for _, key in series)
            ax.annotate(f"{table[c]['speedup']:.2f}x\ntau {table[c]['tau']:.2f}", (i, top), ha="center",
                        va="bottom", fontsize=7, textcoords="offset points", xytext=(0, 2))
        ax.set_xticks(range(len(cats)), [c.replace("_", "\n") for c in cats], fontsize=8)
        ax.set_ylabel("decode tokens/s (batch 1)")
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.15)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
