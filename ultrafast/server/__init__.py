"""The OpenAI-compatible service: `ultrafast serve`, API keys and tiers, prices, the ledger, metrics.

| file | what |
|---|---|
| `protocol.py` | the request and response bodies (pydantic), OpenAI's shapes |
| `errors.py` | errors in OpenAI's shape `{"error": {message, type, param, code}}` and their status codes |
| `db.py` | the database: SQLite (WAL) by default, PostgreSQL for a `postgresql://` URL |
| `auth.py` | API keys (stored as sha256), tiers they may use, tokens-per-minute limits |
| `pricing.py` | $ per million tokens per model and tier, from TOML/JSON or built-in defaults |
| `ledger.py` | one row per finished or cancelled request, written by one thread, one transaction per row |
| `metrics.py` | Prometheus metrics in a per-app registry |
| `scheduler.py` | one worker thread per model: a bounded queue, KV cache slots, token-level interleaving |
| `app.py` | the FastAPI application |
| `commands.py` | `ultrafast serve / keys / usage / loadtest` |
| `loadtest.py` | concurrent streaming clients against a running server |

Nothing here imports torch at module level (the engine, which does, is loaded by the worker threads), so
`ultrafast keys` and `ultrafast usage` start fast. Per-token logprobs are the engine's own record: the sampler
notes each emitted token's (`SamplingParams.logprobs`) and every `StreamEvent` carries its token's.
"""
