"""Which of the target's own layers make a draft worth running (the `self_spec` drafter).

    python -m ultrafast.benchmarks.self_spec [--model qwen2.5-coder-1.5b] [--per-category 1] [--tokens 48]
                                             [--layers 0-8,18-27 ...]

Generates greedy answers to Spec-Bench first turns with the full model, then, at every generated position,
drafts the next token with each candidate layer subset (early exits, skipped blocks, every other layer
skipped; `--layers` adds your own) from the full model's KV rows, as the drafter does. Prints per subset: the
layers it keeps, its measured cost c (a draft forward in target 1-token forwards), its agreement a with the
full model's token (the chance a first draft is accepted), and the best speedup the adaptive policy could
expect from it at the measured verify cost r(k): (1 + a + ... + a^k) / (r(k+1) + c k) at the best k >= 1
(below 1.00x the policy does not draft). The same with r(k) = 1, verification as free per row as on a
large GPU.
"""

from __future__ import annotations

import argparse

import torch


def candidate_sets(n: int) -> dict[str, list[int]]:
    from ..drafters.self_spec import default_layers

    sets = {f"exit after {L}": list(range(L)) for L in (n // 2, 3 * n // 4, n - 2)}
    sets["skip middle third (default)"] = default_layers(n)
    lo, hi = n // 4, n - 2
    sets[f"skip every other in {lo}..{hi - 1}"] = [i for i in range(n) if not (lo <= i < hi and (i - lo) % 2)]
    sets[f"skip {n // 2 - 2}..{n - 5}"] = [i for i in range(n) if not n // 2 - 2 <= i < n - 4]
    return {k: v for k, v in sets.items() if 0 < len(v) < n}  # (small models: no empty draft, no full one)


def agreement(engine, questions, sets: dict[str, list[int]], tokens: int) -> tuple[dict[str, float], int]:
    from ..sampler import SamplingParams

    hits, total = dict.fromkeys(sets, 0), 0
    for _cat, text in questions:
        prompt = engine.chat_prompt([{"role": "user", "content": text}])
        out = engine.generate(prompt, SamplingParams(max_tokens=tokens)).token_ids
        seq = prompt + out
        cache = engine.new_cache()
        engine.forward(seq[:len(prompt) - 1], 0, cache=cache)
        for j in range(len(prompt), len(seq)):
            for name, layers in sets.items():  # the draft of seq[j] from seq[j-1], over the full model's rows
                logits = engine.forward([seq[j - 1]], j - 1, cache=cache, layers=layers)[-1]
                hits[name] += int(logits.argmax()) == seq[j]
            engine.forward([seq[j - 1]], j - 1, cache=cache)  # the full model's row back in place
            total += 1
    return {k: v / total for k, v in hits.items()}, total


def main(argv=None) -> int:
    from ..drafters.self_spec import parse_layers
    from ..engine import Engine, _step_time
    from ..speculative import expected_speedup, measure_r
    from .spec_bench import default_questions_path, load_questions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--per-category", type=int, default=1, help="Spec-Bench questions per category")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens generated per question")
    ap.add_argument("--layers", action="append", default=[], help="a layer subset to add, e.g. 0-8,18-27")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.from_model(args.model, max_context=4096)
    n = engine.config.n_layers
    sets = candidate_sets(n)
    for text in args.layers:
        sets[text] = parse_layers(text, n)
    r = measure_r(engine)
    full = _step_time(engine, reps=15)
    costs = {k: _step_time(engine, layers, reps=15) / full for k, layers in sets.items()}
    questions = load_questions(default_questions_path(), args.per_category)
    agree, total = agreement(engine, questions, sets, args.tokens)
    print(f"self-speculation on {engine.loaded.path.name} ({n} layers), {len(questions)} Spec-Bench first turns, "
          f"{total} greedy positions; r(2)={r[2]:.2f} r(4)={r[4]:.2f}")
    print(f"{'draft':34}{'layers':>7}{'cost c':>8}{'agree a':>9}{'expected (r measured)':>23}{'(r = 1)':>12}")
    flat = [1.0] * len(r)
    for name, layers in sets.items():
        here, k = expected_speedup(agree[name], r, costs[name])
        free, kf = expected_speedup(agree[name], flat, costs[name])
        print(f"{name:34}{len(layers):>4}/{n:<2}{costs[name]:8.2f}{agree[name]:9.3f}{here:17.2f}x k={k:<2}"
              f"{free:8.2f}x k={kf}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
