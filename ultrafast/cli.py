"""The `ultrafast` command line: pull, generate, chat."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from .registry import DEFAULT_MODEL, MODELS


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the output (-2..2)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the output (-2..2)")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


ACT_BITS_HELP = ("precision of the activations inside the quantized linears: 16 (default) or 8 (int8 per "
                 "block of 32 on the AVX512-VNNI kernels; on AVX2 CPUs per 256 for Q4_K and Q6_K, per 32 for the "
                 "other types; as llama.cpp rounds them to int8; about twice the multiply rate in prefill and "
                 "verification, outputs move slightly)")
EVAL_ACT_BITS_HELP = ("the activations of the server started for the run: 16 (default) or 8 (see serve); a "
                      "server at --url runs with its own")

DRAFTERS_HELP = ("ultrafast drafters, comma-separated from grammar,prompt_lookup,suffix,draft_model,self_spec,head "
                 "(default: grammar,suffix,prompt_lookup, plus draft_model with --draft-model and head with a draft "
                 "head; grammar drafts the tokens a request's grammar forces)")
DRAFT_HEAD_HELP = ("a draft head for the ultrafast tier: a file from `ultrafast train-draft`, 'auto' (default: the "
                   "one trained for this model file under $ULTRAFAST_HOME/drafts, if any) or 'none'")
SELF_SPEC_HELP = ("the target layers the self_spec drafter runs, e.g. 0-8,18-27 (default: all but the middle "
                  "third)")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a pulled name ({', '.join(MODELS)}) or a path to a GGUF file or HF folder "
                        f"(default {DEFAULT_MODEL}; names are pulled on first use)")
    p.add_argument("--max-context", type=int, default=None, help="KV cache size in tokens (default 4096)")
    p.add_argument("--activation-bits", type=int, choices=[16, 8], default=16, help=ACT_BITS_HELP)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--tier", choices=["standard", "ultrafast"], default="standard",
                   help="standard: plain decoding; ultrafast: lossless speculative decoding (same output)")
    p.add_argument("--drafters", default=None,
                   help=DRAFTERS_HELP)
    p.add_argument("--draft-model", default=None, help="a smaller model sharing the tokenizer (name or path)")
    p.add_argument("--self-spec-layers", default=None, help=SELF_SPEC_HELP)
    p.add_argument("--draft-head", default="auto", help=DRAFT_HEAD_HELP)


def _grammar(args):
    """--json-schema FILE, --grammar FILE or --regex RE -> a grammar.Grammar (None without one)."""
    from .grammar import Grammar

    if getattr(args, "json_schema", None):
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                schema = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{args.json_schema}: not JSON: {e}") from None
        return Grammar.json_schema(schema)
    if getattr(args, "grammar", None):
        with open(args.grammar, encoding="utf-8") as f:
            return Grammar("ebnf", f.read())
    if getattr(args, "regex", None):
        return Grammar("regex", args.regex)
    return None


def _params(args):
    from .sampler import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
        stop=list(args.stop), grammar=_grammar(args))


def _resident_mb() -> str:
    """The process's resident memory now and its peak so far (Linux: VmRSS, VmHWM), as "N MB, peak M MB", or
    "unknown"."""
    try:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        now, peak = (int(status[k].split()[0]) / 1e3 for k in ("VmRSS", "VmHWM"))
        return f"{now:.0f} MB, peak {peak:.0f} MB"
    except (OSError, ValueError, IndexError, KeyError):
        return "unknown"


def _load_engine(args):
    from .engine import Engine
    from .pull import resolve_model

    path = resolve_model(args.model)  # a first pull is not load time
    t0 = time.perf_counter()
    tp = None
    if getattr(args, "tp", 1) != 1:
        from .tensor_parallel import init

        tp = init(args.tp, args.device or "cpu")
        if not tp.leader:  # every rank runs the same passes; rank 0 speaks
            sys.stdout = sys.stderr = open(os.devnull, "w")
    engine = Engine.from_model(str(path), max_context=args.max_context, device=args.device,
                               draft_model=args.draft_model, activation_bits=args.activation_bits,
                               self_spec_layers=args.self_spec_layers, draft_head=args.draft_head, tp=tp)
    info = engine.describe()
    print(f"loaded {path.name} in {time.perf_counter() - t0:.1f}s: {info['layers']} layers, "
          f"weights {info['weight_bytes_held'] / 1e6:.0f} MB in memory ({info['weight_bytes_layout'] / 1e6:.0f} MB of them "
          f"the kernels' layouts, {info['weight_bytes_in_file'] / 1e6:.0f} MB more read from the file's mapping) for "
          f"{info['file_tensor_bytes'] / 1e6:.0f} MB in the file (process resident {_resident_mb()}), "
          f"{info['weight_bytes_per_token'] / 1e6:.0f} MB read per token; KV cache "
          f"{info['max_context']} tokens = {info['kv_cache_bytes'] / 1e6:.0f} MB; {info['device']}",
          file=sys.stderr)
    if getattr(args, "tier", None) == "ultrafast" and not info["batch_invariant"]:
        print("warning: these kernels are not batch-invariant (PyTorch's own ops): the ultrafast tier's tokens "
              "equal the standard tier's only up to rounding, where a near-tie may flip", file=sys.stderr)
    return engine


def _report(res, stream=sys.stderr) -> None:
    print(f"\n[{res.prompt_tokens} prompt tokens, TTFT {res.ttft_s * 1000:.0f} ms "
          f"({res.prefill_tokens_per_s:.0f} tok/s prefill); {res.completion_tokens} tokens at "
          f"{res.decode_tokens_per_s:.1f} tok/s decode, {res.achieved_gb_per_s:.1f} GB/s of weights; "
          f"finish: {res.finish_reason}" + (f"; tier {res.tier}, tau {res.spec['tau']:.2f}" if res.spec else "") + "]",
          file=stream)


def _tier(args) -> dict:
    from .drafters import parse_drafters

    return {"tier": args.tier, "drafters": parse_drafters(args.drafters)}


def _stream_to(engine, ids, params, out, tier: dict) -> object:
    it = engine.stream(ids, params, **tier)
    while True:
        try:
            ev = next(it)
        except StopIteration as done:
            return done.value
        if ev.text:
            out.write(ev.text)
            out.flush()


def cmd_pull(args) -> int:
    from .pull import pull

    for name in args.names:
        print(pull(name, force=args.force))
    return 0


def _line_prompt(engine, obj: dict, lineno: int) -> list[int]:
    if not isinstance(obj, dict):
        raise ValueError(f"line {lineno}: expected a JSON object")
    if "messages" in obj:
        if not isinstance(obj["messages"], list):
            raise ValueError(f"line {lineno}: 'messages' must be a list")
        return engine.chat_prompt(obj["messages"])
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError(f"line {lineno}: 'prompt' must be a string")
        return engine.raw_prompt(obj["prompt"])
    raise ValueError(f"line {lineno}: needs 'messages' or 'prompt'")


def cmd_generate(args) -> int:
    if (args.prompt is None) == (args.prompts_file is None):
        raise ValueError("give exactly one of --prompt and --prompts-file")
    params = _params(args)  # validate before the (slow) load
    engine = _load_engine(args)
    if params.grammar is not None:
        engine.grammars.compile(params.grammar)  # one the library refuses: an error before any output
    if args.prompts_file:
        if not args.json:
            raise ValueError("--prompts-file needs --json")
        with open(args.prompts_file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    ids = _line_prompt(engine, obj, lineno)
                    line_params = params if obj.get("max_tokens") is None else \
                        dataclasses.replace(params, max_tokens=obj["max_tokens"])  # (validated again)
                    res = engine.generate(ids, line_params, **_tier(args))
                    print(json.dumps(res.to_json()), flush=True)
                except (ValueError, TypeError) as e:  # one bad line gets an error record, the rest still run
                    print(json.dumps({"line": lineno, "error": str(e)}), flush=True)
        return 0
    if args.raw:
        ids = engine.raw_prompt(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.prompt}]
        ids = engine.chat_prompt(messages)
    if args.json:
        print(json.dumps(engine.generate(ids, params, **_tier(args)).to_json()))
    else:
        _report(_stream_to(engine, ids, params, sys.stdout, _tier(args)))
    return 0


def cmd_chat(args) -> int:
    _params(args)
    engine = _load_engine(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat: empty line or Ctrl-D to quit, /reset to forget the conversation", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        try:
            res = _stream_to(engine, engine.chat_prompt(messages), _params(args), sys.stdout, _tier(args))
        except ValueError as e:  # e.g. the conversation outgrew the context: say so and keep chatting
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": res.text})
        _report(res)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ultrafast", description="Lossless fast LLM inference")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("pull", help="fetch a registered model into the cache")
    s.add_argument("names", nargs="*", default=[DEFAULT_MODEL], choices=sorted(MODELS), metavar="NAME")
    s.add_argument("--force", action="store_true", help="fetch again even if cached")
    s.set_defaults(fn=cmd_pull)

    s = sub.add_parser("generate", help="generate a completion")
    _model_args(s)
    s.add_argument("--prompt", help="the user message (or the raw text with --raw)")
    s.add_argument("--prompts-file", help="JSONL of {'messages': [...]} or {'prompt': '...'}, one answer line each")
    s.add_argument("--raw", action="store_true", help="no chat template: complete the text as given")
    s.add_argument("--system", help="a system message (chat mode)")
    s.add_argument("--json", action="store_true", help="print one JSON record per answer")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON matching this JSON schema")
    g.add_argument("--grammar", metavar="FILE", help="constrain the output to this EBNF grammar (xgrammar's GBNF)")
    g.add_argument("--regex", help="constrain the output to this regular expression")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: launch with `torchrun "
                                                     "--nproc-per-node N $(which ultrafast) generate --tp N ...`")
    _sampling_args(s)
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("tp-check", help="tensor parallelism under torchrun: both tiers identical at degree N, "
                                        "agreement with one process (tokens, logits), the all-reduces' cost")
    s.add_argument("--model", default=DEFAULT_MODEL)
    s.add_argument("--tp", type=int, default=2)
    s.add_argument("--prompts-file", default=None, help='JSONL of {"prompt": "..."} (default: four built in)')
    s.add_argument("--max-tokens", type=int, default=48)
    s.add_argument("--max-context", type=int, default=1024)
    s.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    s.add_argument("--json", help="also write the figures as JSON to this file")
    s.set_defaults(fn=lambda a: __import__("ultrafast.benchmarks.tp_check", fromlist=["main"]).main(a))

    s = sub.add_parser("chat", help="interactive chat, streaming")
    _model_args(s)
    s.add_argument("--system", help="a system message")
    _sampling_args(s)
    s.set_defaults(fn=cmd_chat)
    s = sub.add_parser("bench", help="batch-1 decode speed against the memory roofline and llama.cpp")
    s.add_argument("--model", default=DEFAULT_MODEL)
    s.add_argument("--prompt-tokens", type=int, default=128)
    s.add_argument("--gen-tokens", type=int, default=256)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--max-k", type=int, default=16, help="largest k for r(k)")
    s.add_argument("--activation-bits", type=int, choices=[16, 8], default=16, help=ACT_BITS_HELP)
    s.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even if installed")
    s.add_argument("--json", help="also write the figures as JSON to this file ('-': stdout), and a picture beside "
                                  "it (.png)")
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("specbench", help="Spec-Bench in both tiers: speedup, tau, exactness")
    s.add_argument("--model", default=DEFAULT_MODEL)
    s.add_argument("--draft-model", default=None)
    s.add_argument("--drafters", default=None, help=DRAFTERS_HELP)
    s.add_argument("--self-spec-layers", default=None, help=SELF_SPEC_HELP)
    s.add_argument("--draft-head", default="auto", help=DRAFT_HEAD_HELP)
    s.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default ../shared/data/spec_bench)")
    s.add_argument("--per-category", type=int, default=5, help="questions per category (default 5)")
    s.add_argument("--all", action="store_true", help="all 480 questions")
    s.add_argument("--fixed-k", type=int, default=None,
                   help="no adaptive policy: every pass drafts K tokens, the drafters taking turns (an exactness "
                        "check that exercises every drafter; slower)")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--max-context", type=int, default=4096)
    s.add_argument("--activation-bits", type=int, choices=[16, 8], default=16, help=ACT_BITS_HELP)
    s.add_argument("--no-llama-cpp", action="store_true")
    s.add_argument("--json", help="also write the table as JSON to this file, and a picture beside it (.png)")
    s.set_defaults(fn=lambda a: __import__("ultrafast.benchmarks.spec_bench", fromlist=["main"]).main(a))

    s = sub.add_parser("acceptance", help="how often each drafter is right, depth by depth, on the target's own "
                                          "greedy answers to Spec-Bench (chains and the head's trees)")
    s.add_argument("--model", default=DEFAULT_MODEL)
    s.add_argument("--draft-head", default="auto", help=DRAFT_HEAD_HELP)
    s.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default ../shared/data/spec_bench)")
    s.add_argument("--per-category", type=int, default=5, help="questions per category (default 5)")
    s.add_argument("--all", action="store_true", help="all 480 questions")
    s.add_argument("--max-tokens", type=int, default=128, help="tokens of each greedy answer (default 128)")
    s.add_argument("--depth", type=int, default=5, help="chain length asked of each drafter (default 5)")
    s.add_argument("--nodes", default="4,8,16", help="the head's tree budgets, comma-separated (default 4,8,16)")
    s.add_argument("--stride", type=int, default=1, help="draft at every Nth position (default 1: every one)")
    s.add_argument("--batch", type=int, default=16, help="answers generated together (default 16)")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--max-context", type=int, default=4096)
    s.add_argument("--json", help="also write the figures as JSON to this file, and a picture beside it (.png)")
    s.set_defaults(fn=lambda a: __import__("ultrafast.benchmarks.acceptance", fromlist=["main"]).main(a))

    s = sub.add_parser("agentbench", help="an agent loop editing one file: what prompt lookup and suffix decoding earn")
    s.add_argument("--model", default=DEFAULT_MODEL)
    s.add_argument("--draft-model", default=None)
    s.add_argument("--drafters", default=None, help=DRAFTERS_HELP)
    s.add_argument("--self-spec-layers", default=None, help=SELF_SPEC_HELP)
    s.add_argument("--draft-head", default="auto", help=DRAFT_HEAD_HELP)
    s.add_argument("--iterations", type=int, default=6)
    s.add_argument("--max-tokens", type=int, default=512)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--max-context", type=int, default=4096)
    s.add_argument("--activation-bits", type=int, choices=[16, 8], default=16, help=ACT_BITS_HELP)
    s.add_argument("--json", help="also write the figures as JSON to this file, and a picture beside it (.png)")
    s.set_defaults(fn=lambda a: __import__("ultrafast.benchmarks.agent_loop", fromlist=["main"]).main(a))

    s = sub.add_parser("jsonbench", help="structured output over 50 JSON schemas in both tiers: validity, exactness, "
                                          "speedup and the mask's cost")
    s.add_argument("--model", default=DEFAULT_MODEL)
    s.add_argument("--drafters", default=None, help=DRAFTERS_HELP)
    s.add_argument("--draft-head", default="auto", help=DRAFT_HEAD_HELP)
    s.add_argument("--schemas", type=int, default=50, help="how many of the 50 schemas (default all)")
    s.add_argument("--max-tokens", type=int, default=512)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--max-context", type=int, default=2048)
    s.add_argument("--json", help="also write the figures as JSON to this file, and a picture beside it (.png)")
    s.set_defaults(fn=lambda a: __import__("ultrafast.benchmarks.json_output", fromlist=["main"]).main(a))

    s = sub.add_parser("roofline", help="batch-1 decode bounds by hardware: this CPU (measured), N of them with "
                                        "tensor parallelism, H100/H200, a wafer-scale engine; with the ultrafast tier")
    s.add_argument("--model", default=DEFAULT_MODEL, help="a model file whose bytes per token head the table "
                                                          "(beside reference sizes)")
    s.add_argument("--machines", default="1,2,4,8", help="machine counts for this CPU with tensor parallelism")
    s.add_argument("--tau", type=float, default=1.5, help="the ultrafast tier's tokens per pass to apply (default 1.5)")
    s.add_argument("--draft-k", type=int, default=4, help="rows per verify pass, for r(k) (default 4)")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--json", help="also write the table as JSON to this file, and a picture beside it (.png)")
    s.set_defaults(fn=lambda a: __import__("ultrafast.benchmarks.roofline", fromlist=["main"]).main(a))

    s = sub.add_parser("evals", help="whole jobs through the server, per tier: best-of-N with execution")
    evals = s.add_subparsers(dest="eval", required=True)
    e = evals.add_parser("humaneval", help="HumanEval best-of-N: N candidates per problem in one request, each run "
                                           "against the tests in a sandbox, the first passing kept")
    e.add_argument("--model", default=DEFAULT_MODEL, help="served for the run (unless --url)")
    e.add_argument("--url", default=None, help="a running server instead (e.g. http://127.0.0.1:8000)")
    e.add_argument("--api-key", default=None)
    e.add_argument("--n", type=int, default=10, help="candidates per problem (one request with n = N)")
    e.add_argument("--tier", choices=["standard", "ultrafast", "both"], default="both")
    e.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the same problems with n = 1 (the wall-clock N candidates are read against)")
    e.add_argument("--limit", type=int, default=None, help="the first K problems only (default all 164)")
    e.add_argument("--temperature", type=float, default=0.8)
    e.add_argument("--top-p", type=float, default=0.95)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--max-tokens", type=int, default=512)
    e.add_argument("--exec-timeout", type=float, default=10.0, help="seconds per candidate's run")
    e.add_argument("--max-context", type=int, default=2048)
    e.add_argument("--threads", type=int, default=None)
    e.add_argument("--activation-bits", type=int, choices=[16, 8], default=None, help=EVAL_ACT_BITS_HELP)
    e.add_argument("--out", default="humaneval-records.jsonl", help="one JSON line per problem and run, appended")
    e.add_argument("--resume", action="store_true",
                   help="take --out's records made with the same settings instead of running them again")
    e.add_argument("--json", default=None, help="also write the summary as JSON to this file")
    e.set_defaults(fn=lambda a: __import__("ultrafast.evals.humaneval", fromlist=["run"]).run(a))

    e = evals.add_parser("suite", help="question sets run to completion in each tier through the server: "
                                       "wall-clock per tier, tokens and spend")
    e.add_argument("--model", default=DEFAULT_MODEL, help="served for the run (unless --url)")
    e.add_argument("--url", default=None, help="a running server instead (e.g. http://127.0.0.1:8000)")
    e.add_argument("--api-key", default=None)
    e.add_argument("--sets", default="specbench,humaneval", help="specbench (480 first turns), humaneval (164), agent (the agent loop's 6 edits "
                                                              "of one file, each returning the whole file)")
    e.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default ../shared/data/spec_bench)")
    e.add_argument("--tier", choices=["standard", "ultrafast", "both"], default="both")
    e.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (agents run several)")
    e.add_argument("--limit", type=int, default=None, help="the first K prompts of each set")
    e.add_argument("--per-category", type=int, default=None,
                   help="Spec-Bench: the first N questions of each category (MT-Bench's eight count as one, as in "
                        "specbench)")
    e.add_argument("--max-tokens", type=int, default=256)
    e.add_argument("--max-context", type=int, default=4096)
    e.add_argument("--threads", type=int, default=None)
    e.add_argument("--activation-bits", type=int, choices=[16, 8], default=None, help=EVAL_ACT_BITS_HELP)
    e.add_argument("--out", default="suite-records.jsonl", help="one JSON line per request, appended")
    e.add_argument("--json", default=None, help="also write the summary as JSON (and a PNG beside it)")
    e.set_defaults(fn=lambda a: __import__("ultrafast.evals.suite", fromlist=["run"]).run(a))

    s = sub.add_parser("train-draft", help="train a draft head for a model on this machine (the ultrafast tier "
                                            "uses it when present)")
    s.add_argument("--model", default=DEFAULT_MODEL)
    _recipe_args(s)
    s.add_argument("--out", default=None, help="where to save the head (default $ULTRAFAST_HOME/drafts/...)")
    s.add_argument("--restart", action="store_true", help="discard the features and checkpoint of an earlier run")
    s.add_argument("--threads", type=int, default=2)
    s.set_defaults(fn=cmd_train_draft)

    from .server.commands import add_commands as add_server_commands  # serve, keys, usage, loadtest

    add_server_commands(sub)
    return p


def _recipe_args(p: argparse.ArgumentParser) -> None:
    from dataclasses import fields

    from .training import Recipe

    helps = {"tokens": "training tokens of target features", "seq_len": "tokens per sequence (its first ones)",
             "epochs": "passes over the features", "depth": "drafting depth trained (passes per sequence)",
             "lr": "peak learning rate", "batch_tokens": "rows per optimizer step",
             "draft_vocab": "draft vocabulary size (0: a fifth of the target's)",
             "ffn_dim": "the head's FFN width (0: the target's, at most 3x its width)",
             "code_share": "share of training tokens from standard-library Python code",
             "heldout": "held-out conversations for the report", "reg_weight": "weight of the feature loss",
             "seed": "data order and initialisation",
             "bf16": "train under bf16 autocast where this CPU's bf16 matmul is the faster (1) or always in fp32 (0)",
             "source": "text: the corpus as written; greedy: its prompts continued by the target's own greedy "
                       "tokens (what the tier verifies at temperature 0; code-share is then a share of prompts)",
             "gen_batch": "prompts continued together in batched passes (source greedy)",
             "features": "the training features' forward: bf16 (bf16 weights, PyTorch's bf16 matmul), int8 (the "
                         "packed kernels at 8-bit activations), packed (the engine's own kernels as it serves) or "
                         "auto (int8 where this CPU has integer kernels for the file and no bf16 multiplier, else "
                         "bf16); held-out features are always the engine's",
             "extra_layers": "target layers whose outputs the head reads beside the last one's (EAGLE-3's fused "
                             "features): empty for none, eagle3 for the third and the middle layer, or indices "
                             "like 2,12"}
    for f in fields(Recipe):
        kind = {"int": int, "float": float, "str": str,
                "bool": lambda v: bool(int(v))}[f.type if isinstance(f.type, str) else f.type.__name__]
        extra = {"choices": {"source": Recipe.SOURCES, "features": Recipe.FEATURES}[f.name]} \
            if f.name in ("source", "features") else {}
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default,
                       help=f"{helps[f.name]} (default {f.default})", **extra)


def cmd_train_draft(args) -> int:
    from dataclasses import fields

    from .training import Recipe, train_draft

    import torch

    recipe = Recipe(**{f.name: getattr(args, f.name) for f in fields(Recipe)})
    torch.set_num_threads(args.threads)
    train_draft(args.model, recipe, restart=args.restart, out=args.out)
    return 0


def cmd_bench(args) -> int:
    from .benchmarks.decode import main as bench_main

    return bench_main(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RuntimeError) as e:  # our errors are ValueErrors with a clear message
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
