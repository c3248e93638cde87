"""`ultrafast serve`, `ultrafast keys`, `ultrafast usage`, `ultrafast loadtest`: added to the main parser by
`add_commands`. Heavy imports (torch, fastapi, uvicorn) happen inside the commands that need them."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..registry import DEFAULT_MODEL, MODELS


def _db_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=None,
                   help="SQLite file or postgresql:// URL (default $ULTRAFAST_HOME/ultrafast.db)")


def add_commands(sub) -> None:
    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    s.add_argument("--model", action="append", default=None, metavar="M",
                   help=f"a pulled name ({', '.join(MODELS)}) or a GGUF/HF path; repeatable, each served under "
                        f"its name (registry name or file stem) (default {DEFAULT_MODEL})")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; keys are required "
                                                       "on any non-loopback address)")
    s.add_argument("--port", type=int, default=8000)
    _db_arg(s)
    s.add_argument("--require-keys", action="store_true", help="require API keys on loopback too")
    s.add_argument("--prices", default=None, help="price table, TOML or JSON (default: built-in prices)")
    s.add_argument("--slots", type=int, default=4, help="KV cache slots per model = requests generating at once "
                                                        "(default 4)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting per model before 429 (default 64)")
    s.add_argument("--max-context", type=int, default=None, help="KV cache size per slot in tokens (default 4096)")
    s.add_argument("--max-body", type=int, default=8 * 1024 * 1024, help="largest request body in bytes (413 past)")
    s.add_argument("--ultrafast-weight", type=int, default=4,
                   help="steps an ultrafast request advances per scheduling round to a standard one's 1 (default 4)")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    s.add_argument("--activation-bits", type=int, choices=[16, 8], default=16,
                   help="activations inside the quantized linears: 16 (default) or 8 (int8 per block of 32 on the VNNI "
                        "kernels; on AVX2 per 256 for Q4_K and Q6_K, per 32 for the other types; as llama.cpp rounds them to int8: faster "
                        "prefill and verification, outputs move slightly); both tiers use it")
    s.add_argument("--threads", type=int, default=None,
                   help="compute threads per model (default: torch's, one per core); fewer than the cores leaves "
                        "room for the HTTP side")
    s.add_argument("--drafters", default=None,
                   help="the ultrafast tier's drafters, comma-separated from grammar,prompt_lookup,suffix,"
                        "draft_model,self_spec,head (default: grammar,suffix,prompt_lookup, plus draft_model with "
                        "--draft-model and head with a draft head)")
    s.add_argument("--draft-head", default="auto",
                   help="a draft head from `ultrafast train-draft`: a file, 'auto' (default: the one trained for the "
                        "model file, if any) or 'none'")
    s.add_argument("--draft-model", default=None,
                   help="a smaller model sharing the tokenizer, drafting for the (one) --model: name or path")
    s.add_argument("--self-spec-layers", default=None, help="the self_spec drafter's layers, e.g. 0-8,18-27")
    s.add_argument("--fixed-draft-k", type=int, default=None,
                   help="no draft policy: every ultrafast pass drafts K tokens, the drafters taking turns (an "
                        "exactness check; slower than the policy)")
    s.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: launch with `torchrun --nproc-per-node N $(which ultrafast) serve "
                        "--tp N ...`; rank 0 serves, the others run its passes (one --model)")
    s.add_argument("--no-warmup", action="store_true", help="skip measuring r(k) for the ultrafast tier at start")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(fn=cmd_serve)

    k = sub.add_parser("keys", help="create, list and revoke API keys")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    c = ksub.add_parser("create", help="create a key (the secret is printed once)")
    c.add_argument("--name", required=True)
    c.add_argument("--tiers", default="standard", help="comma-separated: standard[,ultrafast] (default standard)")
    c.add_argument("--tpm", type=int, default=None, help="tokens per minute limit (default: none)")
    c.add_argument("--json", action="store_true")
    _db_arg(c)
    c.set_defaults(fn=cmd_keys_create)
    ls = ksub.add_parser("list", help="list keys (never their secrets)")
    ls.add_argument("--json", action="store_true")
    _db_arg(ls)
    ls.set_defaults(fn=cmd_keys_list)
    r = ksub.add_parser("revoke", help="revoke a key by id")
    r.add_argument("key_id")
    _db_arg(r)
    r.set_defaults(fn=cmd_keys_revoke)

    u = sub.add_parser("usage", help="spend per key, model, tier and day, from the ledger")
    u.add_argument("--json", action="store_true")
    u.add_argument("--key", default=None, help="only this key id")
    u.add_argument("--since", default=None, help="only days >= YYYY-MM-DD")
    _db_arg(u)
    u.set_defaults(fn=cmd_usage)

    lt = sub.add_parser("loadtest", help="concurrent streaming clients against a running server (loopback)")
    lt.add_argument("--url", default="http://127.0.0.1:8000")
    lt.add_argument("--clients", type=int, default=32)
    lt.add_argument("--seconds", type=float, default=None, help="default 30 (600 with --soak)")
    lt.add_argument("--model", default=None, help="default: the server's first model")
    lt.add_argument("--tier-mix", default=None,
                    help="share of clients per tier, e.g. standard=0.75,ultrafast=0.25 (default standard=1; "
                         "standard=0.5,ultrafast=0.5 with --soak)")
    lt.add_argument("--max-tokens", type=int, default=64)
    lt.add_argument("--api-key", default=None, help="default: $ULTRAFAST_API_KEY or none")
    lt.add_argument("--probe-tokens", type=int, default=96,
                    help="tokens of the ultrafast probe, alone and under load (0: skip)")
    lt.add_argument("--solo-seconds", type=float, default=10,
                    help="first, one client alone for this long (whole requests), to divide the aggregate by "
                         "(0: skip)")
    lt.add_argument("--soak", action="store_true",
                    help="a soak (`ultrafast/server/soak.py`): a mix of tiers, n = 2, disconnects and bad requests; "
                         "reports RSS over time and ledger totals against /metrics (defaults: 32 clients, 600 s, "
                         "standard=0.5,ultrafast=0.5; no probe, no baseline)")
    lt.add_argument("--json", action="store_true", help="print the results as JSON")
    lt.set_defaults(fn=cmd_loadtest)

    cl = sub.add_parser("cluster", help="replicas of `serve` on one PostgreSQL database behind HAProxy "
                                        "(`ultrafast/server/cluster.py`)")
    csub = cl.add_subparsers(dest="cluster_command", required=True)
    up = csub.add_parser("up", help="PostgreSQL + N replicas + HAProxy on this machine, for a try-out (Ctrl-C stops)")
    up.add_argument("--replicas", type=int, default=2)
    up.add_argument("--host", default="127.0.0.1", help="the balancer's bind address")
    up.add_argument("--port", type=int, default=8000, help="the balancer's port")
    up.add_argument("--db", default=None, help="a postgresql:// URL shared by the replicas (default: a throwaway "
                                               "cluster from Debian's PostgreSQL binaries)")
    up.add_argument("--model", action="append", default=None, metavar="M", help=f"as serve's (default {DEFAULT_MODEL})")
    up.add_argument("--slots", type=int, default=4, help="per replica")
    up.add_argument("--threads", type=int, default=None,
                    help="compute threads per replica (default: the cores shared among the replicas)")
    up.add_argument("--require-keys", action="store_true")
    up.add_argument("--prices", default=None)
    up.add_argument("--serve-args", default="", help="more `serve` options for every replica, one string")
    up.set_defaults(fn=cmd_cluster_up)
    hc = csub.add_parser("haproxy-config", help="print the HAProxy configuration for replicas on other hosts")
    hc.add_argument("--bind", default="0.0.0.0:8000", help="HOST:PORT the balancer listens on")
    hc.add_argument("--replica", action="append", required=True, metavar="HOST:PORT", help="repeatable")
    hc.add_argument("--errors-dir", default="/etc/haproxy/errors/ultrafast",
                    help="where the OpenAI-shaped error files live (written there with --write-errors)")
    hc.add_argument("--write-errors", action="store_true", help="also write the error files into --errors-dir")
    hc.set_defaults(fn=cmd_cluster_haproxy_config)


def cmd_serve(args) -> int:
    import logging

    import uvicorn

    from ..drafters import parse_drafters
    from ..pull import resolve_model
    from .app import ServerConfig, create_app, model_name

    models = []
    for m in args.model or [DEFAULT_MODEL]:
        path = resolve_model(m)
        models.append((model_name(m), path))
    tp = None
    if args.tp != 1:
        from ..tensor_parallel import follow, init

        if len(models) != 1:
            raise ValueError("--tp serves one --model")
        tp = init(args.tp, args.device or "cpu")
        if not tp.leader:  # this rank runs the passes rank 0 sends, until it stops
            from ..engine import Engine

            follow(Engine.from_path(models[0][1], max_context=args.max_context, device=args.device,
                                    activation_bits=args.activation_bits, tp=tp), tp)
            return 0
    drafters = parse_drafters(args.drafters)
    if args.draft_model and len(models) != 1:
        raise ValueError("--draft-model drafts for one model: serve exactly one --model with it")
    if drafters is not None and "draft_model" in drafters and not args.draft_model:
        raise ValueError("the draft_model drafter needs --draft-model")
    config = ServerConfig(models=models, host=args.host, port=args.port, db=args.db, require_keys=args.require_keys,
                          prices=args.prices, slots=args.slots, max_queue=args.max_queue,
                          max_context=args.max_context, max_body_bytes=args.max_body,
                          ultrafast_weight=args.ultrafast_weight, device=args.device, warmup=not args.no_warmup,
                          threads=args.threads, activation_bits=args.activation_bits, drafters=drafters,
                          draft_model=resolve_model(args.draft_model) if args.draft_model else None,
                          self_spec_layers=args.self_spec_layers, draft_head=args.draft_head,
                          fixed_draft_k=args.fixed_draft_k, tp=tp)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    srv = app.state.server
    try:
        srv.start()  # load the models now, so that a model that cannot load is an `error:` line, not a traceback
    except RuntimeError:
        srv.stop()
        raise
    print(f"ultrafast serve: models {', '.join(n for n, _ in models)} on http://{args.host}:{args.port}/v1; "
          f"database {srv.db.describe()}; keys {'required' if config.keys_required else 'not required (local mode)'}",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


def _store(args):
    from .auth import KeyStore
    from .db import Database

    return KeyStore(Database(args.db))


def cmd_keys_create(args) -> int:
    secret, rec = _store(args).create(args.name, args.tiers, args.tpm)
    if args.json:
        print(json.dumps({"key": secret, **rec}))
    else:
        print(secret)
        print(f"created key {rec['key_id']} ({rec['name']}), tiers {','.join(rec['tiers'])}"
              + (f", {rec['tpm']} tokens/min" if rec["tpm"] else "") + ": the secret above is shown only once",
              file=sys.stderr)
    return 0


def cmd_keys_list(args) -> int:
    keys = _store(args).list()
    if args.json:
        print(json.dumps(keys))
        return 0
    if not keys:
        print("no keys")
        return 0
    for k in keys:
        created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(k["created_at"]))
        print(f"{k['key_id']}  {k['name']:<20} {','.join(k['tiers']):<20} "
              f"{(str(k['tpm']) + ' tpm') if k['tpm'] else 'no limit':<12} {k['status']:<8} created {created} UTC")
    return 0


def cmd_keys_revoke(args) -> int:
    rec = _store(args).revoke(args.key_id)
    print(f"revoked key {rec['key_id']} ({rec['name']})")
    return 0


def cmd_usage(args) -> int:
    from . import ledger
    from .db import Database

    db = Database(args.db).init()
    records = ledger.usage(db, key_id=args.key, all_keys=args.key is None, since_day=args.since)
    if args.json:
        print(json.dumps(records))
    else:
        print(ledger.format_usage(records))
    return 0


def cmd_loadtest(args) -> int:
    import os

    from .loadtest import LoadTest, parse_tier_mix

    key = args.api_key or os.environ.get("ULTRAFAST_API_KEY")
    if args.soak:
        from .soak import Soak

        lt = Soak(url=args.url, clients=args.clients, seconds=args.seconds or 600, model=args.model,
                  tier_mix=parse_tier_mix(args.tier_mix or "standard=0.5,ultrafast=0.5"),
                  max_tokens=args.max_tokens, api_key=key)
    else:
        lt = LoadTest(url=args.url, clients=args.clients, seconds=args.seconds or 30, model=args.model,
                      tier_mix=parse_tier_mix(args.tier_mix or "standard=1"), max_tokens=args.max_tokens,
                      api_key=key, probe_tokens=args.probe_tokens, solo_seconds=args.solo_seconds)
    report = lt.run()
    print(json.dumps(report, indent=1) if args.json else lt.format(report))
    if args.soak:  # a soak passes with no errors and the ledger agreeing with the metrics
        return 0 if report["completed"] > 0 and not report["errors"] and report["billing"]["equal"] else 1
    return 0 if report["completed"] > 0 else 1


def cluster_serve_args(args) -> list[str]:
    import shlex

    out = []
    for m in args.model or [DEFAULT_MODEL]:
        out += ["--model", m]
    out += ["--slots", str(args.slots)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.require_keys:
        out.append("--require-keys")
    if args.prices:
        out += ["--prices", args.prices]
    return out + shlex.split(args.serve_args)


def cmd_cluster_up(args) -> int:
    from .cluster import Cluster
    from .db import is_postgres_url
    from .process import sigterm_as_interrupt

    if args.db is not None and not is_postgres_url(args.db):
        raise ValueError("--db: replicas share a PostgreSQL database (a postgresql:// URL); SQLite is one process's")
    cluster = Cluster(args.replicas, cluster_serve_args(args), port=args.port, host=args.host, db=args.db)
    cluster.start(log=sys.stderr)
    print(f"ultrafast cluster: {args.replicas} replicas behind {cluster.url}/v1 (files in {cluster.workdir}); "
          "Ctrl-C stops it", file=sys.stderr)
    dead: set[int] = set()
    try:
        with sigterm_as_interrupt():
            while True:  # the balancer routes around a replica that dies; say so once
                time.sleep(1)
                for i, r in enumerate(cluster.replicas, 1):
                    if not r.alive() and i not in dead:
                        dead.add(i)
                        print(f"replica {i} exited (status {r.proc.returncode}; log {r.log})", file=sys.stderr)
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


def cmd_cluster_haproxy_config(args) -> int:
    from pathlib import Path

    from . import cluster

    text = cluster.haproxy_config(args.bind, args.replica, args.errors_dir)
    if args.write_errors:
        cluster.write_error_files(Path(args.errors_dir))
    print(text, end="")
    return 0
