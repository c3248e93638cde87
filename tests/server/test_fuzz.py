"""Fuzzing the running server from outside with schemathesis, over the server's own OpenAPI document.

Stateless: every operation gets generated requests, valid and invalid, checked by schemathesis' default
checks (no 5xx, status codes, content types, headers and bodies as documented). Stateful: random sequences
of operations. Bounded: `ULTRAFAST_FUZZ_EXAMPLES` examples per operation (default 20) on a server whose
context is 96 tokens, so that no generation runs long. The closing check: the server still serves, and its
ledger holds only rows of requests that reached generation (a refused request is never billed).
"""

from __future__ import annotations

import os
import sqlite3
import zlib
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from ultrafast.server.auth import KeyStore
from ultrafast.server.db import Database

MODEL = "smollm2-135m"
EXAMPLES = int(os.environ.get("ULTRAFAST_FUZZ_EXAMPLES", "20"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def fuzz_env(server_factory):
    db = str(server_factory.tmp / "fuzz.db")
    key = KeyStore(Database(db)).create("fuzzer", "standard,ultrafast")[0]
    srv = server_factory(db, "--require-keys", "--max-context", "96", "--slots", "2", "--max-queue", "8",
                         "--no-warmup")
    env = {"srv": srv, "db": db, "auth": {"Authorization": f"Bearer {key}"}, "statuses": Counter(),
           "semantic_400s": Counter()}
    yield env
    print(f"\nfuzzing: {sum(env['statuses'].values())} requests, statuses {dict(sorted(env['statuses'].items()))}; "
          f"schema-valid requests refused: {dict(env['semantic_400s'])}")


@pytest.fixture(scope="module")
def api_schema(fuzz_env):
    return schemathesis.openapi.from_url(fuzz_env["srv"].url + "/openapi.json", headers=fuzz_env["auth"])


def _aim(case) -> None:
    """Two in three generated bodies name the served model, so that they reach generation (a random model
    name is a 404 before anything else is looked at)."""
    body = case.body
    if isinstance(body, dict) and "model" in body and zlib.crc32(repr(sorted(body)).encode()) % 3:
        body["model"] = MODEL


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_stateless(api_schema, fuzz_env, mode):
    """Each operation, with schema-valid (positive) or schema-violating (negative) requests."""
    operations = [r.ok() for r in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/metrics"}
    for op in operations:
        @FUZZ
        @given(case=op.as_strategy(generation_mode=mode))
        def check(case):
            _aim(case)
            response = case.call(headers=fuzz_env["auth"], timeout=120)
            fuzz_env["statuses"][response.status_code] += 1
            assert response.status_code < 500, (case.path, case.body, response.text[:500])
            if mode is GenerationMode.POSITIVE:
                # a schema-valid request passes the server's own schema validation; it may still be refused
                # for what a schema cannot say (the prompt over the context, top_logprobs without logprobs,
                # token ids past the vocabulary): a 400 with the server's own code, never pydantic's
                if response.status_code == 400:
                    err = response.json()["error"]
                    assert err["code"] not in ("invalid_value", "invalid_json", "invalid_request"), \
                        (case.path, case.body, err)
                    fuzz_env["semantic_400s"][err["message"][:40]] += 1
                case.validate_response(response, headers=fuzz_env["auth"],
                                       excluded_checks=[schemathesis.checks.positive_data_acceptance])
        try:
            check()
        except Unsatisfiable:  # nothing to violate: an operation with no parameters and no body
            assert mode is GenerationMode.NEGATIVE and not op.body and op.path in ("/health", "/metrics", "/v1/models", "/v1/usage"), op.path


def test_stateful(api_schema, fuzz_env):
    machine = api_schema.as_state_machine()

    class Workflow(machine):
        def before_call(self, case):
            _aim(case)

        def get_call_kwargs(self, case):
            return {"headers": fuzz_env["auth"], "timeout": 120}

        def after_call(self, response, case):
            fuzz_env["statuses"][response.status_code] += 1

    Workflow.run(settings=settings(max_examples=max(3, EXAMPLES // 4), stateful_step_count=6, deadline=None,
                                   suppress_health_check=list(HealthCheck), derandomize=True))


def test_the_server_still_serves_and_bills_only_generations(fuzz_env):
    srv = fuzz_env["srv"]
    r = httpx.post(srv.base_url + "/chat/completions", headers=fuzz_env["auth"], timeout=120,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    with sqlite3.connect(fuzz_env["db"]) as db:
        rows = db.execute("SELECT status, prompt_tokens FROM ledger").fetchall()
    assert rows and all(s in ("finished", "cancelled") and p >= 1 for s, p in rows), rows
    assert fuzz_env["statuses"][200] >= 1
