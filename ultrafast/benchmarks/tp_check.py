"""`ultrafast tp-check`: tensor parallelism against itself and against one process, under torchrun.

`torchrun --nproc-per-node N $(which ultrafast) tp-check --tp N --model M`: every rank loads its share; rank 0
also loads the whole model (degree 1). Per prompt, greedy:
- both tiers at degree N: the ultrafast tier must emit exactly the standard tier's tokens (exit status 1 if not);
- degree N against degree 1: the tokens, and the largest difference of the logits over the prompt and the
  generated text fed back (teacher-forced, so both see the same rows);
- the cost of the all-reduces per generated token (timed around each one), and decode tokens/s at both degrees.
"""

from __future__ import annotations

import json
import sys

import torch

DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash map is.",
    "Translate to French: the weather is nice today.",
    "def quicksort(xs):",
]


def _logits(engine, ids: list[int]) -> torch.Tensor:
    cache = engine.new_cache()
    return engine.model(torch.tensor(ids), 0, cache, all_logits=True).float()


def main(args) -> int:
    from ..engine import Engine
    from ..sampler import SamplingParams
    from ..tensor_parallel import init

    if args.tp < 2:
        raise ValueError("tp-check compares a tensor-parallel degree (--tp 2 or more) against one process")
    tp = init(args.tp)
    torch.set_num_threads(max(1, args.threads))
    prompts = DEFAULT_PROMPTS
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    out = sys.stdout if tp.leader else None
    par = Engine.from_model(args.model, max_context=args.max_context, tp=tp, draft_head="none")
    one = Engine.from_model(args.model, max_context=args.max_context, draft_head="none") if tp.leader else None
    params = SamplingParams(max_tokens=args.max_tokens)
    rows, exact = [], True
    for text in prompts:
        ids = par.chat_prompt([{"role": "user", "content": text}])
        reduce0, n0 = tp.reduce_s, tp.reduces
        std = par.generate(ids, params, tier="standard")
        reduce_s, reduces = tp.reduce_s - reduce0, tp.reduces - n0
        fast = par.generate(ids, params, tier="ultrafast")
        full = ids + std.token_ids
        lp = _logits(par, full)
        row = {"prompt": text[:60], "tokens": len(std.token_ids), "tiers_identical": std.token_ids == fast.token_ids,
               "tp_tokens_per_s": std.decode_tokens_per_s, "tau": fast.spec.get("tau"),
               "all_reduces_per_token": reduces / max(1, std.completion_tokens),
               "all_reduce_ms_per_token": 1000 * reduce_s / max(1, std.completion_tokens)}
        exact &= row["tiers_identical"]
        if one is not None:
            ref = one.generate(ids, params, tier="standard")
            l1 = _logits(one, full)
            agree = sum(a == b for a, b in zip(ref.token_ids, std.token_ids))
            row.update({"same_tokens_as_tp1": ref.token_ids == std.token_ids,
                        "tokens_agreeing_with_tp1": agree, "tp1_tokens_per_s": ref.decode_tokens_per_s,
                        "max_logit_diff": float((lp - l1).abs().max()),
                        "argmax_agreement": float((lp.argmax(-1) == l1.argmax(-1)).float().mean())})
            rows.append(row)
    if out is not None:
        print(f"tensor parallelism, degree {tp.world} (gloo), {args.model}: {len(prompts)} prompts, greedy, "
              f"{args.max_tokens} tokens, {torch.get_num_threads()} thread(s) per rank", file=out)
        for r in rows:
            print(f"- {r['prompt']!r}: tiers identical at degree {tp.world}: {'yes' if r['tiers_identical'] else 'NO'}; "
                  f"tokens as degree 1: {r['tokens_agreeing_with_tp1']}/{r['tokens']}; max |logit diff| "
                  f"{r['max_logit_diff']:.2e} (argmax agrees on {100 * r['argmax_agreement']:.1f}% of rows); "
                  f"{r['all_reduces_per_token']:.0f} all-reduces = {r['all_reduce_ms_per_token']:.1f} ms per token; "
                  f"decode {r['tp_tokens_per_s']:.1f} tok/s (degree 1: {r['tp1_tokens_per_s']:.1f})", file=out)
        print(f"ultrafast output identical to standard at degree {tp.world}: {'yes' if exact else 'NO'}", file=out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"degree": tp.world, "model": str(args.model), "rows": rows, "exact": exact}, f, indent=2)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0 if exact else 1

