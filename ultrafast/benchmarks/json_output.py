"""`ultrafast jsonbench`: structured output over 50 JSON schemas of varied shapes (nested objects, enums, arrays,
numbers with bounds, strings with patterns), greedy, in both tiers side by side: every output parsed and
validated (jsonschema), the tiers' outputs compared token for token, tokens/s per tier and the speedup (keys and
punctuation the schema forces are drafts that are always right), and the cost of constrained decoding (mask
time per token)."""

from __future__ import annotations

import json
import sys
import time

from ..grammar import Grammar
from .. import report
from ..report import Progress
from ..sampler import SamplingParams
from . import drafters_line, sum_drafters

_NAMES = ["Ada", "a city", "a book", "a product", "a recipe", "a planet", "a company", "a song", "a car", "a cat"]
_STR = {"type": "string", "maxLength": 24}


def _field(kind: int, depth: int) -> dict:
    """One property's schema; `kind` picks the shape."""
    k = kind % 9
    if k == 0:
        return dict(_STR)
    if k == 1:
        return {"type": "integer", "minimum": 0, "maximum": 10 ** (1 + kind % 4)}
    if k == 2:
        return {"type": "number", "minimum": -100, "maximum": 100}
    if k == 3:
        return {"enum": ["low", "medium", "high", "critical"][: 2 + kind % 3]}
    if k == 4:
        return {"type": "boolean"}
    if k == 5:
        return {"type": "array", "items": dict(_STR), "minItems": 1, "maxItems": 1 + kind % 4}
    if k == 6:
        return {"type": "string", "pattern": ["^[A-Z]{3}-[0-9]{4}$", "^[a-z]{1,12}@[a-z]{1,10}\\.com$",
                                              "^\\+?[0-9]{7,12}$", "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"][kind % 4]}
    if k == 7 and depth < 2:
        return _object(kind * 7 + 3, 2 + kind % 3, depth + 1)
    if k == 8 and depth < 2:
        return {"type": "array", "items": _object(kind * 5 + 1, 2, depth + 1), "minItems": 1, "maxItems": 2}
    return {"type": "integer", "minimum": -5, "maximum": 5}


_KEYS = ["name", "id", "score", "level", "active", "tags", "code", "owner", "items", "count", "price", "email",
         "date", "notes", "rank", "phone", "kind", "labels", "address", "children"]


def _object(seed: int, n: int, depth: int = 0) -> dict:
    keys = [_KEYS[(seed * 7 + i * 3) % len(_KEYS)] for i in range(n)]
    keys = list(dict.fromkeys(keys))
    props = {k: _field(seed + i * 5, depth) for i, k in enumerate(keys)}
    return {"type": "object", "properties": props, "required": keys, "additionalProperties": False}


def schemas(n: int = 50) -> list[tuple[str, dict]]:
    """n (prompt, schema) pairs, deterministic, shapes varying with the index."""
    out = []
    for i in range(n):
        schema = _object(i, 2 + i % 5)
        what = _NAMES[i % len(_NAMES)]
        out.append((f"Describe {what} as a JSON object with the fields {', '.join(schema['properties'])}.", schema))
    return out


def run(engine, pairs, *, tier: str, max_tokens: int, drafters=None, progress=sys.stderr):
    rows = []
    bar = Progress(len(pairs), f"JSON schemas, {tier}", "schema", file=progress)
    for i, (prompt, schema) in enumerate(pairs):
        ids = engine.chat_prompt([{"role": "user", "content": prompt}])
        res = engine.generate(ids, SamplingParams(max_tokens=max_tokens, grammar=Grammar.json_schema(schema)),
                              tier=tier, drafters=drafters)
        rows.append(res)
        bar.note(f"  {tier} {i + 1}/{len(pairs)}: {len(res.token_ids)} tokens, {res.decode_tokens_per_s:.1f} tok/s")
        bar.update(1)
    bar.close()
    return rows


def validate(text: str, schema: dict) -> str | None:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return str(e).splitlines()[0][:120]
    return None


def main(args) -> int:
    import torch

    from ..drafters import parse_drafters
    from ..engine import Engine

    drafters = parse_drafters(args.drafters)
    if not 1 <= args.schemas <= 50:
        raise ValueError("--schemas must be in [1, 50]")
    torch.set_num_threads(args.threads)
    engine = Engine.from_model(args.model, max_context=args.max_context, draft_head=args.draft_head)
    pairs = schemas(50)[:args.schemas]
    t = time.perf_counter()
    engine.grammars.compile(Grammar.json_schema(pairs[0][1]))
    setup = time.perf_counter() - t
    std = run(engine, pairs, tier="standard", max_tokens=args.max_tokens)
    fast = run(engine, pairs, tier="ultrafast", max_tokens=args.max_tokens, drafters=drafters)
    print(f"JSON output on {engine.loaded.path.name}: {len(pairs)} schemas, greedy, {args.threads} threads, "
          f"drafters {','.join(drafters or engine.default_drafters)}; grammar setup for the vocabulary "
          f"({engine.config.vocab_size} tokens) and the first schema {setup:.1f} s")
    print(f"{'#':>3}{'tokens':>8}{'standard':>10}{'ultrafast':>11}{'speedup':>9}{'tau':>7}  valid  same")
    valid = same_all = 0
    for i, ((_, schema), a, b) in enumerate(zip(pairs, std, fast)):
        errs = [validate(r.text, schema) for r in (a, b)]
        ok = not any(errs)
        same = a.token_ids == b.token_ids
        valid += ok
        same_all += same
        print(f"{i + 1:3d}{len(a.token_ids):8d}{a.decode_tokens_per_s:10.1f}{b.decode_tokens_per_s:11.1f}"
              f"{b.decode_tokens_per_s / max(a.decode_tokens_per_s, 1e-9):8.2f}x{b.spec['tau']:7.2f}  "
              f"{'yes' if ok else 'NO'}    {'yes' if same else 'NO'}" + (f"  {errs[0] or errs[1]}" if not ok else ""))
    n = sum(len(a.token_ids) - 1 for a in std)
    ts, tf = sum(a.decode_s for a in std), sum(b.decode_s for b in fast)
    tokens = sum(a.completion_tokens for a in std)
    mask_s = sum(a.grammar.get("mask_seconds", 0.0) for a in std)
    masks = sum(a.grammar.get("masks", 0) for a in std)
    step_ms = 1000 * ts / max(n, 1)
    print(f"total: standard {n / ts:.1f} tok/s, ultrafast {n / tf:.1f} tok/s, speedup {ts / tf:.2f}x; "
          f"valid: {valid}/{len(pairs)} in both tiers; identical outputs: {same_all}/{len(pairs)}")
    print(f"constrained decoding's cost (standard tier): {1000 * mask_s / max(masks, 1):.3f} ms per mask, "
          f"{masks / max(tokens, 1):.2f} masks per token, {1000 * mask_s / max(tokens, 1):.3f} ms per token "
          f"= {100 * mask_s / max(tokens, 1) / (step_ms / 1000):.1f}% of a {step_ms:.1f} ms token")
    print(drafters_line(sum_drafters([b.spec for b in fast])))
    figures = {"model": engine.loaded.path.name, "schemas": [
        {"tokens": len(a.token_ids), "standard_tok_s": a.decode_tokens_per_s, "ultrafast_tok_s": b.decode_tokens_per_s,
         "tau": b.spec["tau"], "identical": a.token_ids == b.token_ids} for a, b in zip(std, fast)],
        "standard_tok_s": n / ts, "ultrafast_tok_s": n / tf, "speedup": ts / tf, "valid": valid,
        "identical": same_all, "mask_ms_per_token": 1000 * mask_s / max(tokens, 1)}
    report.write(args.json, figures, lambda png: plot(figures, png))
    return 0 if valid == len(pairs) and same_all == len(pairs) else 1


def plot(figures: dict, path) -> None:
    """Per schema: ultrafast's decode tokens/s against standard's, a point each, the diagonal for equal speed."""
    rows = figures["schemas"]
    with report.figure(path, size=(5.6, 5.0)) as (fig, ax):
        xs, ys = [r["standard_tok_s"] for r in rows], [r["ultrafast_tok_s"] for r in rows]
        ax.scatter(xs, ys, c=[r["tau"] for r in rows], cmap="viridis", s=24)
        top = 1.1 * max(xs + ys)
        ax.plot([0, top], [0, top], "--", color="gray", label="equal speed")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel("standard decode tokens/s")
        ax.set_ylabel("ultrafast decode tokens/s (colour: tau)")
        ax.set_title(f"JSON schemas on {figures['model']}: {len(rows)} schemas, {figures['speedup']:.2f}x overall",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
