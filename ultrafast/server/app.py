"""The FastAPI application: OpenAI's chat completions, completions, responses and models endpoints, plus the
calling key's usage, metrics and a health check.

Everything an app needs lives on `app.state.server` (a `Server`): no module-level mutable state, so
several apps can live in one process (the tests do).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..grammar import GrammarError
from ..tool_calls import to_template_messages
from . import conversations
from . import ledger as ledger_mod
from . import protocol
from . import responses as responses_api
from .auth import LOCAL_USER, KeyStore, Principal, bearer_token, is_loopback, resolve_tier
from .db import Database
from .errors import (APIError, AuthError, ContextOverflow, InvalidRequest, ModelNotFound, PayloadTooLarge,
                     Unavailable, error_body, type_for_status)
from .ledger import LedgerWriter
from .rate_limit import RateLimiter
from .metrics import CONTENT_TYPE, ServerMetrics
from .pricing import PriceTable
from .protocol import (ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, DeletedResponse,
                       ErrorResponse, ModelCard, ModelList, ResponseObject, ResponsesRequest, UsageReport)
from .structured import OutputPlan, plan_chat, plan_completion

log = logging.getLogger("ultrafast.server")

DEFAULT_MAX_BODY = 8 * 1024 * 1024
MAX_CANDIDATES = 16
FINGERPRINT = "fp_ultrafast"


@dataclass
class ServerConfig:
    models: list[tuple[str, Any]]  # (name in requests, path)
    host: str = "127.0.0.1"
    port: int = 8000
    db: str | None = None  # SQLite path or postgresql:// URL (default $ULTRAFAST_HOME/ultrafast.db)
    require_keys: bool = False
    prices: str | None = None
    slots: int = 4
    max_queue: int = 64
    max_context: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    ultrafast_weight: int = 4
    device: str | None = None
    warmup: bool = True
    threads: int | None = None  # torch/OpenMP threads per model worker (default: torch's)
    activation_bits: int = 16  # inside the quantized linears: 16 or 8 (Engine.from_path)
    drafters: list[str] | None = None  # the ultrafast tier's drafters (default: the engine's)
    draft_model: Any = None  # path of a draft model for the (one) model served
    self_spec_layers: str | None = None  # the self_spec drafter's layers, e.g. "0-8,18-27"
    draft_head: str | None = "auto"  # a draft head file, "auto" (the one trained for the model file, if any) or "none"
    fixed_draft_k: int | None = None  # no draft policy: every ultrafast pass drafts this many (exactness checks)
    engine_factories: dict = field(default_factory=dict)  # name -> callable returning an Engine (tests)
    tp: Any = None  # `serve --tp N`: this process is rank 0 (tensor_parallel.TensorParallel); one model

    @property
    def keys_required(self) -> bool:
        return self.require_keys or not is_loopback(self.host)


class Server:
    """The state of one app: database, keys, ledger, prices, metrics, rate limiter, model workers."""

    def __init__(self, config: ServerConfig):
        from .scheduler import ModelWorker  # imports torch lazily, in the worker threads' module

        if not config.models:
            raise ValueError("serve needs at least one --model")
        names = [n for n, _ in config.models]
        if len(set(names)) != len(names):
            raise ValueError(f"two --model arguments have the same name: {names}")
        self.config = config
        self.prices = PriceTable.load(config.prices)
        self.db = Database(config.db).init()
        self.keys = KeyStore(self.db)
        self.ledger = LedgerWriter(self.db)
        self.metrics = ServerMetrics()
        self.limiter = RateLimiter(self.db)
        self.started = time.time()
        self._started = False
        self.workers = {
            name: ModelWorker(name, path, max_context=config.max_context, slots=config.slots,
                              max_queue=config.max_queue, ultrafast_weight=config.ultrafast_weight,
                              metrics=self.metrics, ledger=self.ledger, prices=self.prices, limiter=self.limiter,
                              device=config.device, warmup=config.warmup, threads=config.threads,
                              activation_bits=config.activation_bits, drafters=config.drafters,
                              draft_model=config.draft_model, self_spec_layers=config.self_spec_layers,
                              draft_head=config.draft_head, fixed_draft_k=config.fixed_draft_k, tp=config.tp,
                              engine_factory=config.engine_factories.get(name))
            for name, path in config.models}

    def start(self) -> None:
        """Load every model (in its worker thread) and wait until all are ready; idempotent."""
        if self._started:
            return
        self._started = True
        for w in self.workers.values():
            w.start()
        for w in self.workers.values():
            w.wait_ready()
            log.info("model %s ready: %s", w.name, w.engine.describe())

    def stop(self) -> None:
        for w in self.workers.values():
            w.stop()
        self.ledger.close()
        self.db.close()

    def worker(self, model: str):
        w = self.workers.get(model)
        if w is None:
            raise ModelNotFound(model, list(self.workers))
        return w


def model_name(model: str | Path) -> str:
    """The name a `--model` is addressed by: the registry name, or the file (or folder) stem of a path."""
    from ..registry import MODELS

    if isinstance(model, str) and model in MODELS:
        return model
    p = Path(model)
    return p.name if p.is_dir() else p.stem


# ------------------------------------------------------------------------------------ middleware


class BodyLimitMiddleware:
    """Reads a request body up to `limit` bytes (413 past it), rejects bodies that are not UTF-8 (400),
    then replays it; later `receive` calls (disconnect detection) go to the server."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        cl = headers.get(b"content-length")
        if cl is not None and cl.isdigit() and int(cl) > self.limit:
            return await _send_error(send, PayloadTooLarge(self.limit), scope)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.limit:
                return await _send_error(send, PayloadTooLarge(self.limit), scope)
            chunks.append(body)
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await _send_error(send, InvalidRequest(f"the request body is not valid UTF-8 (byte {e.start})",
                                                          code="invalid_encoding"), scope)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_error(send, err: APIError, scope) -> None:
    app = scope.get("app")
    server = getattr(getattr(app, "state", None), "server", None) if app is not None else None
    if server is not None:
        server.metrics.http_errors.labels(str(err.status), err.code or "").inc()
    payload = json.dumps(err.body(), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers().items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


# ------------------------------------------------------------------------------------ app


def create_app(config: ServerConfig) -> FastAPI:
    server = Server(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(server.start)
        try:
            yield
        finally:
            await asyncio.to_thread(server.stop)

    # /openapi.json and /docs are routes of ours (`_install_routes`): behind a key where keys are required
    app = FastAPI(title="ultrafast", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None,
                  description="OpenAI-compatible LLM inference with a standard and a lossless ultrafast tier.")
    app.state.server = server
    app.add_middleware(BodyLimitMiddleware, limit=config.max_body_bytes)
    _install_error_handlers(app)
    _install_routes(app)
    app.mount("/static", StaticFiles(directory=PAGE_DIR), name="static")
    return app


# the race page: static files, no build step; its script talks to the API like any client
PAGE_DIR = Path(__file__).parent / "static"
_PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; style-src 'self'; script-src 'self'",
                 "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def _error_response(request: Request | None, err: APIError, headers: dict | None = None) -> JSONResponse:
    if request is not None:
        srv = getattr(request.app.state, "server", None)
        if srv is not None:
            srv.metrics.http_errors.labels(str(err.status), err.code or "").inc()
    return JSONResponse(err.body(), status_code=err.status, headers={**(headers or {}), **err.headers()})


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None, "invalid_request"
    # a union reports every branch: the branch of the right type, failing a constraint, says what is wrong
    e = next((x for x in errors if not x.get("type", "").endswith("_type")), errors[0])
    if e.get("type") == "json_invalid":
        ctx = e.get("ctx") or {}
        return (f"We could not parse the JSON body of your request: {ctx.get('error', 'invalid JSON')} "
                f"(at position {e['loc'][-1] if e.get('loc') else '?'})"), None, "invalid_json"
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # pydantic reports every member of a union; name the field, not the union branch
    param = ".".join(x for x in loc if not x.startswith(("list[", "str", "int", "function-", "union[", "constrained-"))
                     and not _is_model_name(x))
    if not loc:
        msg = "the request body must be a JSON object" if e.get("type") in ("model_attributes_type", "dict_type") \
            else e.get("msg", "invalid request")
        return msg, None, "invalid_request"
    return f"Invalid value for '{param or '.'.join(loc)}': {e.get('msg')}", param or None, "invalid_value"


def _is_model_name(name: str) -> bool:
    """A union member's class name in a validation error's location (`input.0.InputMessage.content`)."""
    obj = getattr(protocol, name, None)
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        msg, param, code = _validation_message(exc)
        return _error_response(request, InvalidRequest(msg, param=param, code=code))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            msg = f"Unknown request URL: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"Method {request.method} is not allowed for {request.url.path} (allowed: {(exc.headers or {}).get('Allow', '')})"
        # exc.headers: the router's Allow on a 405
        return _error_response(request, APIError(msg, status=exc.status_code, type=type_for_status(exc.status_code),
                                                 code=None), headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return _error_response(request, APIError(f"internal server error: {type(exc).__name__}", status=500,
                                                 type="server_error", code="internal_error"))


async def authenticate(request: Request) -> Principal:
    srv: Server = request.app.state.server
    token = bearer_token(request.headers.get("authorization"))
    if token is None:
        if srv.config.keys_required:
            raise AuthError("You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                            "(create one with `ultrafast keys create`).", code="missing_api_key")
        return LOCAL_USER
    try:
        return await asyncio.to_thread(srv.keys.verify, token)
    except AuthError:
        if srv.config.keys_required:
            raise
        return LOCAL_USER  # local mode: a placeholder key (the openai client insists on one) is fine


_AUTH_ERRORS = {401: {"model": ErrorResponse}, 500: {"model": ErrorResponse}}
_ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}, 403: {"model": ErrorResponse},
           404: {"model": ErrorResponse}, 413: {"model": ErrorResponse}, 429: {"model": ErrorResponse},
           500: {"model": ErrorResponse}, 503: {"model": ErrorResponse}}
# a generation's 200: JSON, or with "stream": true server-sent events (`data: {chunk}` lines, then `data: [DONE]`)
_GENERATION = {**_ERRORS, 200: {"content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "description": "one server-sent event",
    "properties": {"data": {"type": "string", "description": "a JSON chunk (or an error object), or [DONE]"}}}}}}}


def openapi_document(app: FastAPI) -> dict:
    """FastAPI's document, made to say what the server does: validation errors are 400s in OpenAI's shape
    (FastAPI documents them as 422s), and every /v1 route takes a bearer key."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        doc.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "an API key (`ultrafast keys create`); optional on loopback without "
                                      "--require-keys"}}
        for path, ops in doc.get("paths", {}).items():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
                if path != "/health":
                    op["security"] = [{"bearer": []}]
        app.openapi_schema = doc
    return app.openapi_schema


def _install_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def race_page():
        """The race page: a prompt streamed by both tiers side by side, and the server's own figures."""
        return FileResponse(PAGE_DIR / "index.html", media_type="text/html", headers=_PAGE_HEADERS)

    @app.get("/health")
    async def health(request: Request):
        """Liveness for load balancers: no key, ever."""
        srv: Server = request.app.state.server
        return {"status": "ok", "models": list(srv.workers),
                "queue_depth": {n: w.queue_depth for n, w in srv.workers.items()}}

    # operational endpoints: open on loopback, behind a key where keys are required (--require-keys or a
    # public interface)
    @app.get("/metrics", response_class=PlainTextResponse, responses={
        **_AUTH_ERRORS, 200: {"content": {CONTENT_TYPE.split(";")[0]: {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format"}})
    async def metrics(request: Request, who: Principal = Depends(authenticate)):
        return PlainTextResponse(request.app.state.server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request, who: Principal = Depends(authenticate)):
        return JSONResponse(openapi_document(request.app))

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request, who: Principal = Depends(authenticate)) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="ultrafast API")

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models(request: Request, who: Principal = Depends(authenticate)):
        srv: Server = request.app.state.server
        return ModelList(data=[_model_card(srv, n) for n in srv.workers])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model: str, request: Request, who: Principal = Depends(authenticate)):
        srv: Server = request.app.state.server
        srv.worker(model)
        return _model_card(srv, model)

    @app.get("/v1/usage", response_model=UsageReport, responses=_ERRORS)
    async def usage(request: Request, who: Principal = Depends(authenticate)):
        """The calling key's own spend per model, tier and day (the local user's without a key)."""
        srv: Server = request.app.state.server
        data = await asyncio.to_thread(ledger_mod.usage, srv.db, key_id=who.key_id, all_keys=False)
        return UsageReport(key_id=who.key_id, data=data, total_cost_usd=round(sum(r["cost_usd"] for r in data), 8),
                           total_requests=sum(r["requests"] for r in data))

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=_GENERATION)
    async def chat_completions(body: ChatCompletionRequest, request: Request, who: Principal = Depends(authenticate)):
        srv: Server = request.app.state.server
        worker = srv.worker(body.model)
        return await _chat(request, srv, worker, who, body, "chat.completions", f"chatcmpl-{uuid.uuid4().hex}")

    @app.post("/v1/responses", response_model=ResponseObject, responses=_GENERATION)
    async def create_response(body: ResponsesRequest, request: Request, who: Principal = Depends(authenticate)):
        """OpenAI's Responses API: text or items in, message and function_call items out (responses.py)."""
        srv: Server = request.app.state.server
        worker = srv.worker(body.model)
        history = []
        if body.previous_response_id is not None:
            history = await asyncio.to_thread(conversations.conversation, srv.db, body.previous_response_id,
                                              who.key_id)
            if history is None:
                raise InvalidRequest(f"Previous response with id '{body.previous_response_id}' not found.",
                                     param="previous_response_id", code="previous_response_not_found")
        context = history + responses_api.input_items(body)
        with responses_api.responses_params():
            chat = responses_api.to_chat_request(body, responses_api.to_messages(body.instructions, context))

            def output(req, plan):
                return responses_api.ResponseOutput(srv, worker, req, body, plan, context, who.key_id)

            return await _chat(request, srv, worker, who, chat, "responses", responses_api.new_id("resp"), output)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=_ERRORS)
    async def get_response(response_id: str, request: Request, who: Principal = Depends(authenticate)):
        srv: Server = request.app.state.server
        obj = await asyncio.to_thread(conversations.load, srv.db, response_id, who.key_id)
        if obj is None:
            raise APIError(f"No response found with id '{response_id}'.", status=404, type="invalid_request_error",
                           param="response_id", code="response_not_found")
        return JSONResponse(obj)

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=_ERRORS)
    async def delete_response(response_id: str, request: Request, who: Principal = Depends(authenticate)):
        srv: Server = request.app.state.server
        if not await asyncio.to_thread(conversations.delete, srv.db, response_id, who.key_id):
            raise APIError(f"No response found with id '{response_id}'.", status=404, type="invalid_request_error",
                           param="response_id", code="response_not_found")
        return DeletedResponse(id=response_id, deleted=True)

    @app.post("/v1/completions", response_model=Completion, responses=_GENERATION)
    async def completions(body: CompletionRequest, request: Request, who: Principal = Depends(authenticate)):
        srv: Server = request.app.state.server
        worker = srv.worker(body.model)
        tier = resolve_tier(body.service_tier, who)
        _check_common(body, worker.engine.config.vocab_size)
        best_of = body.n if body.best_of is None else body.best_of
        if best_of < body.n:
            raise InvalidRequest(f"best_of ({best_of}) must be greater than or equal to n ({body.n})", param="best_of")
        if best_of > body.n and body.stream:
            raise InvalidRequest("best_of greater than n cannot be streamed: the choices are known only at the end",
                                 param="best_of")
        engine = worker.engine
        plan = plan_completion(body)
        await _compile(engine, plan)
        prompts = _completion_prompts(body.prompt)
        ids_list = []
        for i, p in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                if not p:
                    raise InvalidRequest("the prompt is empty", param=param)
                try:
                    p.encode("utf-8")
                except UnicodeEncodeError as e:  # e.g. a lone surrogate: JSON allows "\ud800", UTF-8 does not
                    raise InvalidRequest(f"the prompt is not valid Unicode: {e.reason} at position {e.start}",
                                         param=param) from None
                ids = await asyncio.to_thread(engine.raw_prompt, p)
            else:
                ids = list(p)
                vocab = engine.config.vocab_size
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise InvalidRequest(f"token ids out of range [0, {vocab}): {bad[:5]}", param=param)
            if not ids:
                raise InvalidRequest("the prompt is empty", param=param)
            ids_list.append(ids)
        if len(ids_list) * best_of > MAX_CANDIDATES:
            raise InvalidRequest(f"at most {MAX_CANDIDATES} completions per request (prompts x best_of)",
                                 param="best_of" if best_of > body.n else "n")
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        for ids in ids_list:
            _budget(ids, max_tokens, engine.max_context, "prompt", "max_tokens")
        return await _run(request, srv, worker, who, tier, "completions", body, ids_list, max_tokens, body.logprobs,
                          f"cmpl-{uuid.uuid4().hex}", plan, best_of=best_of)


async def _chat(request: Request, srv: Server, worker, who: Principal, body: ChatCompletionRequest, endpoint: str,
                req_id: str, output=None):
    """A chat request through the model's template: chat completions, and the Responses API translated."""
    tier = resolve_tier(body.service_tier, who)
    _check_common(body, worker.engine.config.vocab_size)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    messages = _chat_messages(body)
    engine = worker.engine
    plan = plan_chat(body, engine.tokenizer.chat_template, worker.name)
    await _compile(engine, plan)
    try:
        ids = await asyncio.to_thread(engine.chat_prompt, to_template_messages(messages), plan.tools)
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"could not apply the chat template: {e}", param="messages") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = _budget(ids, max_tokens, engine.max_context, "messages",
                         "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
    top = (body.top_logprobs or 0) if body.logprobs else None
    return await _run(request, srv, worker, who, tier, endpoint, body, [ids], max_tokens, top, req_id, plan, output)


def _model_card(srv: Server, name: str) -> ModelCard:
    w = srv.workers[name]
    pricing = {t: srv.prices.price(name, t).to_json() for t in ("standard", "ultrafast")}
    return ModelCard(id=name, created=int(srv.started), max_context=w.engine.max_context if w.engine else None,
                     pricing=pricing)


def _check_common(body, vocab_size: int) -> None:
    """What the schema cannot say: it does not know the model's vocabulary."""
    bad = [t for t in (body.logit_bias or {}) if int(t) >= vocab_size]
    if bad:
        raise InvalidRequest(f"logit_bias: token ids out of range [0, {vocab_size}): {bad[:5]}", param="logit_bias")


def _chat_messages(body: ChatCompletionRequest) -> list[dict]:
    out = []
    for m in body.messages:
        content = m.content
        if isinstance(content, list):  # text parts (the schema admits no others)
            content = "".join(part.text for part in content)
        if content is None:
            content = ""
        role = "system" if m.role == "developer" else m.role
        msg = {"role": role, "content": content}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _completion_prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(x, int) for x in prompt):
        return [prompt]
    return list(prompt)


def _budget(ids: list[int], max_tokens: int | None, max_context: int, where: str, param: str) -> int:
    n = len(ids)
    if n >= max_context:
        raise ContextOverflow(f"This model's maximum context length is {max_context} tokens. However, your "
                              f"{where} resulted in {n} tokens. Please reduce the length of the {where}.", param=where)
    if max_tokens is None:
        return max_context - n
    if n + max_tokens > max_context:
        raise ContextOverflow(f"This model's maximum context length is {max_context} tokens. However, you requested "
                              f"{n + max_tokens} tokens ({n} in the {where}, {max_tokens} for the completion). "
                              f"Please reduce the length of the {where} or {param}.", param=param)
    return max_tokens


async def _compile(engine, plan: OutputPlan) -> None:
    """Compile the request's grammar now (cached for its generations), so that one the library refuses is a 400."""
    if plan.grammar is None:
        return
    try:
        await asyncio.to_thread(engine.grammars.compile, plan.grammar)
    except GrammarError as e:
        raise InvalidRequest(f"{plan.grammar_param}: {e}", param=plan.grammar_param) from None


def _params_factory(body, max_tokens: int, top_logprobs: int | None, grammar=None):
    from ..sampler import SamplingError, SamplingParams

    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    temperature = 1.0 if body.temperature is None else body.temperature

    def make(group: int, index: int):
        kw = dict(temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
                  top_k=body.top_k or 0, min_p=body.min_p or 0.0,
                  repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                  presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                  logit_bias={int(t): b for t, b in body.logit_bias.items()} if body.logit_bias else None,
                  seed=None if body.seed is None else body.seed + index, max_tokens=max_tokens, stop=stop,
                  ignore_eos=bool(body.ignore_eos), logprobs=top_logprobs, grammar=grammar)
        return SamplingParams(**kw)

    try:
        make(0, 0)
    except SamplingError as e:
        raise InvalidRequest(str(e)) from None
    return make


async def _wait_disconnect(request: Request, on_disconnect) -> None:
    try:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                on_disconnect()
                return
    except asyncio.CancelledError:
        pass
    except Exception:  # the server closed the receive channel: treat as gone
        on_disconnect()


async def _run(request: Request, srv: Server, worker, who: Principal, tier: str, endpoint: str, body,
               prompts: list[list[int]], max_tokens: int, top_logprobs: int | None, req_id: str, plan: OutputPlan,
               output=None, best_of: int | None = None):
    """Generate: the whole response, or its stream. `output(req, plan)` makes what builds them (default: chat
    completions' and completions' `_Formatter`): absorb(msg), full_response(summary), async completed(obj),
    stream(queue, include_usage). best_of (completions): candidates per prompt, of which the response keeps the n
    with the highest log probability per token (their logprobs are recorded for that even when not asked for)."""
    from .scheduler import GenRequest

    choose = best_of is not None and best_of > body.n
    if (top_logprobs is not None or choose) and not worker.logprobs_supported:
        raise InvalidRequest("logprobs are not available with this engine build",
                             param="best_of" if choose else "logprobs")
    recorded = 0 if choose and top_logprobs is None else top_logprobs

    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()

    def emit(msg):
        try:
            loop.call_soon_threadsafe(q.put_nowait, msg)
        except RuntimeError:  # the loop is gone (shutdown)
            pass

    req = GenRequest(model=worker.name, tier=tier, endpoint=endpoint, principal=who, prompts=prompts,
                     make_params=_params_factory(body, max_tokens, recorded, plan.grammar),
                     n=best_of if choose else body.n, emit=emit,
                     id=req_id, cache_salt=body.cache_salt)
    reservation = None
    if who.tpm is not None:  # a database transaction: off the event loop
        reservation = await asyncio.to_thread(srv.limiter.admit, who, sum(len(p) for p in prompts))
    try:
        worker.submit(req)
    except APIError:
        if reservation is not None:
            await asyncio.to_thread(srv.limiter.refund, who, reservation)
        raise
    if output is None:
        so = body.stream_options
        fmt = _Formatter(srv, worker, req, endpoint == "chat.completions", top_logprobs, plan,
                         continuous_usage=bool(so and so.include_usage and so.continuous_usage_stats),
                         keep=body.n if choose else None)
    else:
        fmt = output(req, plan)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(fmt.stream(q, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          "X-Request-Id": req.id})
    watcher = asyncio.create_task(_wait_disconnect(request, lambda: (worker.cancel(req), q.put_nowait(("gone",)))))
    done = False
    try:
        while True:
            msg = await q.get()
            kind = msg[0]
            if kind == "gone":
                return Response(status_code=499)
            fmt.absorb(msg)
            if kind == "done":
                done = True
                summary, fut = msg[1], msg[2]
                try:
                    await asyncio.wrap_future(fut)
                except Exception:
                    log.exception("ledger row for %s not written", req.id)
                if summary["status"] == "failed":
                    raise APIError(summary["message"] or "generation failed", status=500, type="server_error",
                                   code="generation_failed")
                if summary["status"] == "cancelled":  # not by this client: the server is stopping
                    raise Unavailable(f"the request was cancelled: {summary['message']}", code="cancelled")
                obj = fmt.full_response(summary)
                await fmt.completed(obj)
                return JSONResponse(obj, headers={"X-Request-Id": req.id})
    finally:
        watcher.cancel()
        if not done:
            worker.cancel(req)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _stream(worker, req, q: asyncio.Queue, fmt: "_Formatter", include_usage: bool):
    completed = False
    try:
        if fmt.chat:
            for c in req.candidates:
                yield _sse(fmt.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}], include_usage))
        open_choices = {c.index for c in req.candidates}
        held_finish = None
        while True:
            msg = await q.get()
            kind = msg[0]
            fmt.absorb(msg)
            if kind == "delta":
                _, index, text, records = msg
                if fmt.parsers is not None:  # tools: content outside calls, then each call as it closes
                    text, calls = fmt.parsers[index].feed(text)
                    for chunk in fmt.call_chunks(index, calls, include_usage):
                        yield chunk
                if text or records:
                    yield _sse(fmt.chunk([fmt.delta_choice(index, text, records)], include_usage))
            elif kind == "choice_done":
                _, index, finish, _result = msg
                open_choices.discard(index)
                if fmt.parsers is not None:
                    rest, calls = fmt.parsers[index].finish()
                    if rest:
                        yield _sse(fmt.chunk([fmt.delta_choice(index, rest, None)], include_usage))
                    for chunk in fmt.call_chunks(index, calls, include_usage):
                        yield chunk
                    finish = fmt.finish_reason(index, finish)
                choice = fmt.delta_choice(index, "", None, finish)
                if open_choices:
                    yield _sse(fmt.chunk([choice], include_usage))
                else:
                    held_finish = choice  # the last one carries time_info
            elif kind == "done":
                summary, fut = msg[1], msg[2]
                try:
                    await asyncio.wrap_future(fut)
                except Exception:
                    log.exception("ledger row for %s not written", req.id)
                completed = True
                if summary["status"] != "finished":
                    failed = summary["status"] == "failed"
                    yield _sse(error_body(summary["message"] or "generation failed" if failed else
                                          f"the request was cancelled: {summary['message']}", "server_error", None,
                                          "generation_failed" if failed else "cancelled"))
                    yield b"data: [DONE]\n\n"
                    return
                if held_finish is not None:
                    c = fmt.chunk([held_finish], include_usage)
                    c["time_info"] = summary["time_info"]
                    yield _sse(c)
                if include_usage:
                    c = fmt.chunk([], include_usage)
                    c["usage"] = fmt.usage(summary)
                    c["time_info"] = summary["time_info"]
                    yield _sse(c)
                yield b"data: [DONE]\n\n"
                return
    finally:
        if not completed:
            worker.cancel(req)


class _Formatter:
    """Builds OpenAI-shaped responses and chunks from the worker's messages."""

    def __init__(self, srv: Server, worker, req, chat: bool, top_logprobs: int | None, plan: OutputPlan,
                 continuous_usage: bool = False, keep: int | None = None):
        self.srv, self.worker, self.req, self.chat, self.top = srv, worker, req, chat, top_logprobs
        self.keep = keep  # best_of: the choices per prompt the whole response keeps (None: all)
        self.continuous_usage = continuous_usage  # every chunk carries the usage so far (vLLM's option)
        self.emitted = 0  # tokens delivered so far, all candidates
        # streaming with tools: per choice, the parser that splits its output into content and tool calls
        self.plan = plan
        self.parsers = {c.index: plan.call_parser() for c in req.candidates} if plan.parse_tools else None
        self.call_index: dict[int, int] = {c.index: 0 for c in req.candidates}
        self.tok = worker.engine.tokenizer
        self.results: dict[int, Any] = {}
        self.finish: dict[int, str] = {}
        self.records: dict[int, list] = {c.index: [] for c in req.candidates}
        self.texts: dict[int, list[str]] = {c.index: [] for c in req.candidates}
        self._tokstr: dict[int, str] = {}

    def stream(self, q: asyncio.Queue, include_usage: bool):
        return _stream(self.worker, self.req, q, self, include_usage)

    async def completed(self, obj: dict) -> None:
        """Nothing to do once a chat completion or completion is whole."""

    def absorb(self, msg) -> None:
        if msg[0] == "delta":
            _, index, text, records = msg
            self.emitted += 1  # one delta per token
            self.texts[index].append(text)
            if records:
                self.records[index].extend(records)
        elif msg[0] == "choice_done":
            self.finish[msg[1]], self.results[msg[1]] = msg[2], msg[3]

    def token_str(self, tid: int) -> str:
        s = self._tokstr.get(tid)
        if s is None:
            s = self._tokstr[tid] = self.tok.token_str(tid)
        return s

    # ---- logprobs

    def chat_logprobs(self, records) -> dict:
        def one(tid, lp):
            s = self.token_str(tid)
            return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

        return {"content": [{**one(r.token_id, r.logprob), "top_logprobs": [one(t, v) for t, v in r.top]}
                            for r in records]}

    def completion_logprobs(self, records, offset: int = 0) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        pos = offset
        for r in records:
            s = self.token_str(r.token_id)
            tokens.append(s)
            lps.append(_finite(r.logprob))
            tops.append({self.token_str(t): _finite(v) for t, v in r.top})
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    # ---- streaming

    def chunk(self, choices: list, include_usage: bool) -> dict:
        c = {"id": self.req.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
             "created": self.req.created, "model": self.req.model, "choices": choices,
             "service_tier": self.req.tier, "system_fingerprint": FINGERPRINT}
        if include_usage:
            c["usage"] = self.running_usage() if self.continuous_usage else None
        return c

    def running_usage(self) -> dict:
        prompt = sum(len(p) for p in self.req.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": self.emitted, "total_tokens": prompt + self.emitted}

    def delta_choice(self, index: int, text: str, records, finish: str | None = None) -> dict:
        if self.chat:
            ch = {"index": index, "delta": {"content": text} if (text or records) else {},
                  "logprobs": self.chat_logprobs(records) if records else None, "finish_reason": finish}
        else:
            offset = sum(len(t) for t in self.texts[index][:-1]) if text else 0
            ch = {"index": index, "text": text,
                  "logprobs": self.completion_logprobs(records, offset) if records else None,
                  "finish_reason": finish}
        return ch

    def call_chunks(self, index: int, calls, include_usage: bool) -> list[bytes]:
        """Choice `index`'s calls as OpenAI streams them: per call its id, type and name with empty arguments,
        then the arguments (SSE events)."""
        out = []
        for call in calls:
            i = self.call_index[index]
            self.call_index[index] = i + 1
            head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            args = {"index": i, "function": {"arguments": call.arguments}}
            out += [_sse(self.chunk([{"index": index, "delta": {"tool_calls": [d]}, "logprobs": None,
                                      "finish_reason": None}], include_usage)) for d in (head, args)]
        return out

    def finish_reason(self, index: int, finish: str | None) -> str | None:
        calls = self.parsers[index].calls if self.parsers is not None else []
        return "tool_calls" if calls and finish == "stop" else finish

    # ---- whole responses

    def usage(self, summary: dict) -> dict:
        return {"prompt_tokens": summary["prompt_tokens"], "completion_tokens": summary["completion_tokens"],
                "total_tokens": summary["prompt_tokens"] + summary["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": summary["cached_tokens"]},
                "completion_tokens_details": {"reasoning_tokens": 0}}

    def kept(self) -> list:
        """The candidates the whole response shows: all, or with best_of the `keep` of each prompt's with the
        highest log probability per token (the earlier candidate first among equals; one with no tokens last),
        in that order."""
        if self.keep is None:
            return list(self.req.candidates)

        def per_token(c) -> float:
            rec = self.records[c.index]
            return sum(r.logprob for r in rec) / len(rec) if rec else float("-inf")

        out = []
        for g in sorted({c.group for c in self.req.candidates}):
            mine = [c for c in self.req.candidates if c.group == g]
            out += sorted(mine, key=lambda c: (-per_token(c), c.index))[:self.keep]
        return out

    def full_response(self, summary: dict) -> dict:
        choices = []
        for shown, c in enumerate(self.kept()):
            res = self.results.get(c.index)
            text = res.text if res is not None else "".join(self.texts[c.index])
            finish = self.finish.get(c.index)
            if self.chat:
                lp = self.chat_logprobs(self.records[c.index]) if self.top is not None else None
                message = {"role": "assistant", "content": text}
                if self.parsers is not None:
                    parser = self.plan.call_parser()
                    parser.feed(text)
                    parser.finish()
                    message["content"] = parser.message_content()
                    if parser.calls:
                        message["tool_calls"] = [call.to_json() for call in parser.calls]
                        finish = "tool_calls" if finish == "stop" else finish
                choices.append({"index": shown, "message": message, "logprobs": lp, "finish_reason": finish})
            else:
                lp = self.completion_logprobs(self.records[c.index]) if self.top is not None else None
                choices.append({"index": shown, "text": text, "logprobs": lp, "finish_reason": finish})
        return {"id": self.req.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.req.created, "model": self.req.model, "choices": choices,
                "usage": self.usage(summary), "service_tier": self.req.tier, "system_fingerprint": FINGERPRINT,
                "time_info": summary["time_info"]}


def _finite(x: float) -> float:
    return x if x > -1e30 else -9999.0
