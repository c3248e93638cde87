"""Benchmarks, each a CLI verb: `bench` (decode vs the memory roofline and llama.cpp), `specbench`
(Spec-Bench, both tiers side by side), `agentbench` (an agent loop re-sending the same file), `jsonbench`
(structured output over 50 JSON schemas), `roofline` (the bandwidth bound of batch-1 decoding by hardware)."""


def tier_engine(args):
    """(engine, drafters) for the benchmarks that race the tiers (`specbench`, `agentbench`) from their common
    options: model, threads, context, drafters, draft model, self-speculation layers, activation bits, head.
    An unknown drafter is an error before the model loads."""
    import torch

    from ..drafters import parse_drafters
    from ..engine import Engine

    drafters = parse_drafters(args.drafters)
    torch.set_num_threads(args.threads)
    engine = Engine.from_model(args.model, max_context=args.max_context, draft_model=args.draft_model,
                               self_spec_layers=args.self_spec_layers,
                               activation_bits=args.activation_bits, draft_head=args.draft_head)
    return engine, drafters


def ceiling_line(r: list[float]) -> str:
    from ..speculative import speedup_ceiling

    best, k = speedup_ceiling(r)
    return (f"ceiling if every draft were accepted: {best:.2f}x (k = {k}; verify cost r(k) "
            + " ".join(f"r({n})={r[n]:.2f}" for n in (2, 4, 8, 16) if n < len(r)) + ")")


def sum_drafters(specs: list[dict]) -> dict[str, dict[str, int]]:
    """Passes, drafted and accepted tokens per drafter, summed over generations' `spec` reports."""
    out: dict[str, dict[str, int]] = {}
    for spec in specs:
        for name, d in spec.get("drafters", {}).items():
            acc = out.setdefault(name, {"passes": 0, "drafted": 0, "accepted": 0})
            for key in acc:
                acc[key] += d[key]
    return out


def drafters_line(by_drafter: dict[str, dict[str, int]]) -> str:
    return "drafters: " + "; ".join(
        f"{k} {d['accepted']}/{d['drafted']} drafts accepted"
        + (f" ({d['accepted'] / d['drafted']:.0%})" if d["drafted"] else "") + f" in {d['passes']} passes"
        for k, d in by_drafter.items())


def figures_verb(compute, table, json_path: str | None) -> int:
    """A figures verb's run: `compute()` (its figures, a dict), then `table(figures)` on stdout and the figures as JSON
    at `json_path` (when given); exit code 0, or one `error:` line and 2 for bad input or a model it cannot load."""
    import json
    import sys

    from ..pull import PullError

    try:
        figures = compute()
    except (ValueError, FileNotFoundError, PullError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(figures))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(figures, f, indent=1)
    return 0
