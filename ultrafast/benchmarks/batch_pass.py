"""What a best-of-n request's batched pass costs, row by row: one pass for several sequences (`Engine.forward_batch`,
the pass the server runs for n candidates) against one sequence with as many rows, and a further row's cost.

    python -m ultrafast.benchmarks.batch_pass [--model qwen2.5-coder-1.5b] [--seqs 10] [--rows 10,13,16]
                                              [--prompt-tokens 180] [--own-tokens 150] [--reps 5] [--threads 2]
                                              [--activation-bits 16|8] [--json F]

--seqs sequences share a prompt of --prompt-tokens (prefilled once and copied into each cache; the pass reads those
rows once, as it does a request's candidates') and hold --own-tokens of their own after it. A pass of R rows (R at
least --seqs) gives every sequence R // seqs rows and the first R % seqs one more (a candidate's row and its drafts),
every row's logits computed. Against it: one sequence in the same context with R rows, every row's logits too, and one
row of one sequence (a decode step). Per R, best of --reps (the three taking turns): the milliseconds of each, r (over
the step's), and the cost of the sequences' own caches (the batched pass less the one sequence's); then the cost of a
further row, the slope between the smallest and the largest R. Token ids are random: the cost does not depend on them.
On the 1.5B a ten-candidate pass is bound by its multiplies, so its wall-clock is close to its rows times that slope.
"""

from __future__ import annotations

import argparse
import time

import torch

from . import figures_verb


def rows_per_sequence(rows: int, seqs: int) -> list[int]:
    """R rows over `seqs` sequences: R // seqs each, the first R % seqs one more."""
    if seqs < 1 or rows < seqs:
        raise ValueError(f"a pass of {rows} rows cannot give each of {seqs} sequences a row")
    return [rows // seqs + (i < rows % seqs) for i in range(seqs)]


def parse_rows(text: str) -> list[int]:
    try:
        rows = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise ValueError(f"--rows takes comma-separated integers, got {text!r}") from None
    if not rows:
        raise ValueError("--rows is empty")
    return rows


def run(model: str, seqs: int, rows: list[int], prompt_tokens: int, own_tokens: int, reps: int = 5,
        threads: int = 2, activation_bits: int = 16) -> dict:
    from ..engine import Engine

    if prompt_tokens < 1 or own_tokens < 0 or reps < 1 or threads < 1:
        raise ValueError("--prompt-tokens, --reps and --threads must be at least 1, --own-tokens at least 0")
    for r in rows:
        rows_per_sequence(r, seqs)
    torch.set_num_threads(threads)
    context = prompt_tokens + own_tokens + max(rows)
    engine = Engine.from_model(model, max_context=context, activation_bits=activation_bits, draft_head=None)
    if context > engine.max_context:
        raise ValueError(f"{context} positions (prompt, own tokens and the largest pass) do not fit {model}'s context "
                         f"of {engine.max_context}")
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, engine.config.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    caches = [engine.new_cache() for _ in range(seqs)]
    engine.forward(ids(prompt_tokens), 0, cache=caches[0])
    for c in caches[1:]:
        c.copy_rows_from(caches[0], 0, prompt_tokens)
    if own_tokens:
        for c in caches:
            engine.forward(ids(own_tokens), prompt_tokens, cache=c)
    pos = prompt_tokens + own_tokens
    share = [None] + [(0, prompt_tokens)] * (seqs - 1)
    new = ids(max(rows))  # each pass writes its rows at pos.., over the last pass's

    def timed(f) -> float:
        t = time.perf_counter()
        f()
        return time.perf_counter() - t

    def batched(r: int) -> float:
        per = rows_per_sequence(r, seqs)
        return timed(lambda: engine.forward_batch([(new[:n], pos, c) for n, c in zip(per, caches)], share=share,
                                                  all_logits=True))

    def single(r: int) -> float:
        return timed(lambda: engine.forward(new[:r], pos, all_logits=True, cache=caches[0]))

    step = timed(lambda: engine.forward(new[:1], pos, cache=caches[0]))  # threads up, buffers sized
    best = {r: [float("inf"), float("inf")] for r in rows}
    for _ in range(reps):
        for r in rows:
            best[r][0] = min(best[r][0], batched(r))
            best[r][1] = min(best[r][1], single(r))
        step = min(step, timed(lambda: engine.forward(new[:1], pos, cache=caches[0])))
    out = [{"rows": r, "batched_ms": b * 1e3, "one_sequence_ms": s * 1e3, "batched_r": b / step,
            "one_sequence_r": s / step, "caches_ms": (b - s) * 1e3} for r, (b, s) in best.items()]
    lo, hi = out[0], out[-1]
    span = hi["rows"] - lo["rows"]
    return {"model": model, "kernels": engine.describe()["kernels"], "threads": threads, "seqs": seqs,
            "prompt_tokens": prompt_tokens, "own_tokens": own_tokens, "reps": reps, "step_ms": step * 1e3,
            "passes": out,
            "further_row_ms": (hi["batched_ms"] - lo["batched_ms"]) / span if span else None,
            "further_row_one_sequence_ms": (hi["one_sequence_ms"] - lo["one_sequence_ms"]) / span if span else None}


def format_table(r: dict) -> str:
    lines = [f"{r['model']}, {r['kernels']}, {r['threads']} threads; {r['seqs']} sequences sharing a "
             f"{r['prompt_tokens']}-token prompt, {r['own_tokens']} tokens each of their own; best of {r['reps']}",
             f"one row of one sequence (a step): {r['step_ms']:.1f} ms",
             f"{'rows':>5} {str(r['seqs']) + ' sequences ms':>16} {'r':>6} {'one sequence ms':>16} {'r':>6} "
             f"{'their caches ms':>16}"]
    for x in r["passes"]:
        lines.append(f"{x['rows']:>5} {x['batched_ms']:>16.1f} {x['batched_r']:>6.2f} {x['one_sequence_ms']:>16.1f} "
                     f"{x['one_sequence_r']:>6.2f} {x['caches_ms']:>16.1f}")
    if r["further_row_ms"] is not None:
        lines.append(f"a further row: {r['further_row_ms']:.2f} ms ({r['further_row_ms'] / r['step_ms']:.3f} of a "
                     f"step) in the batched pass, {r['further_row_one_sequence_ms']:.2f} ms in one sequence")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ultrafast.benchmarks.batch_pass", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--seqs", type=int, default=10, help="sequences in the pass (a request's candidates)")
    ap.add_argument("--rows", default="10,13,16", help="rows per pass, comma-separated, each at least --seqs")
    ap.add_argument("--prompt-tokens", type=int, default=180, help="the prompt the sequences share")
    ap.add_argument("--own-tokens", type=int, default=150, help="each sequence's own tokens after the prompt")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--activation-bits", type=int, choices=(16, 8), default=16,
                    help="the quantized linears' activations: 16 (default) or 8 (llama.cpp's)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    return figures_verb(lambda: run(args.model, args.seqs, parse_rows(args.rows), args.prompt_tokens,
                                    args.own_tokens, args.reps, args.threads, args.activation_bits),
                        format_table, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
