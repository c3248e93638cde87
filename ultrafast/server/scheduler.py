"""Scheduling: one worker thread per model owns its engine; all torch work happens there.

Requests arrive through a bounded queue (`submit` raises QueueFull past `max_queue` requests waiting beyond
the free slots).
The worker keeps a pool of KV cache slots and advances every active candidate one step per round
(continuous batching at token granularity). With an engine that exposes `Engine.start` (a `Generation`
per request) and `Engine.forward_batch`, the standard tier's decode steps of one round run as one batched
pass over the weights (bit-identical to running each alone); otherwise each candidate's `Engine.stream`
generator is stepped in turn. Ultrafast-tier candidates (speculative, their own multi-token passes) are
admitted first and advanced first, `ultrafast_weight` steps per round to the standard tier's one. While
standard requests wait, ultrafast ones hold at most all but a quarter of the slots (at least one is left):
a saturating ultrafast load slows the standard tier, never starves it (a soak with 16 clients in each tier
completed no standard request in 10 minutes before this rule).

Prefix caching: a new candidate goes to the free slot whose `cache.tokens` shares the longest prefix
with its prompt (an agent re-sending its growing conversation prefills only the new part); the engine
reuses those rows and reports them as cached tokens. A slot's rows serve only the tenant (API key; the
local user is one tenant) whose prompt wrote them: a slot taken by another tenant forgets its rows first,
so neither `cached_tokens` nor the time to the first token tells one key anything of another's prompts. A
request's `cache_salt` (vLLM's name) narrows that to the requests of one key with the same salt. The suffix
drafter's history of earlier requests is kept per tenant the same way (`Engine.suffix_cache(scope)`), so an
ultrafast request's drafts, and its speed, never depend on another key's text.

n > 1: the candidates of one prompt share its prefill. The first one is admitted alone; once it has
prefilled, each sibling copies the prompt's KV rows into its own slot (`dst.k[:, :, :m] = src.k[:, :, :m]`,
same for v, then `dst.tokens`) and takes its first token from the logits the first one computed for the prompt's
last row (kept until the siblings have started): its prefill runs no forward (without those logits: one token).
While candidates of one prompt have written the same tokens (samples of one answer often agree for long
stretches), a batched pass computes their rows once (`_same_rows`): the first of them feeds its token and drafts,
the others' slots get those rows' keys and values, and each samples (verifies) from the same logits with its own
sampler.

Ultrafast candidates decode together too, in batched passes, while those pay more than their own
speculative passes (by the engine's measured r(k) and each candidate's measured tokens per step-time). Each
offers its lookups' drafts to the batched pass, which keeps those that pay for their rows
(`speculative.share_rows`) and lets each candidate verify its own rows; the
first candidate of such a request prefills and waits for its siblings, and the group batches from the round
after their prefills. Now and then one candidate speculates alone (a probe) to re-measure its drafts; the
group probes on one clock that backs off while probes lose to the batch (`_probe`).

Cancellation (a client that went away) closes the candidate's generator at once (the engine keeps the
cache consistent) and frees its slot. Every request ends in exactly one ledger row: finished, cancelled
or failed. Results flow to the asyncio side with `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from ..speculative import batch_cost, drafts_may_pay, share_rows
from .auth import Principal
from .rate_limit import RateLimiter
from .errors import QueueFull, Unavailable
from .ledger import SETTLE_S, SETTLE_TOKENS, LedgerRow, LedgerWriter
from .metrics import ServerMetrics
from .pricing import PriceTable

log = logging.getLogger("ultrafast.server")

TIER_ORDER = ("ultrafast", "standard")


@dataclass
class Slot:
    index: int
    cache: Any  # KVCache
    owner: "Candidate | None" = None
    last_used: float = 0.0
    # whose prompt wrote the rows in `cache`: (Principal.key_id, None: the local user; the request's cache_salt)
    tenant: tuple = (None, None)


@dataclass
class Candidate:
    req: "GenRequest"
    index: int  # the choice index in the response
    group: int  # which prompt of the request (completions may send several)
    prompt_ids: list[int]
    params: Any  # SamplingParams
    state: str = "pending"  # pending, active, done
    slot: Slot | None = None
    gen: Any = None
    prefilled: bool = False
    cached_tokens: int = 0
    events: int = 0
    first_t: float | None = None
    last_t: float | None = None
    result: Any = None  # GenerationResult
    finish_reason: str | None = None
    spec_rate: float = 1.0  # ultrafast: tokens per target step-time of its own passes (EMA) ...
    spec_passes: int = 0  # ... over this many passes
    batched_rounds: int = 0  # ultrafast: rounds in a batched plain pass since it last speculated alone (a probe)
    probed: bool = False  # ... whether it has been probed
    probe_won: bool = False  # ... and whether its last probe's drafts beat the batched pass
    borrowed_prefill: bool = False  # its prefill was handed its source's logits (no forward of its own)

    @property
    def logprobs(self) -> bool:
        return self.params.logprobs is not None

    @property
    def completion_tokens(self) -> int:
        """Its tokens to bill: the sampled ones once finished, the delivered ones before."""
        return self.result.completion_tokens if self.result is not None else self.events


@dataclass
class GenRequest:
    """One API request: one or more candidates (n, or several prompts), and the way back to its handler."""

    model: str
    tier: str
    endpoint: str
    principal: Principal
    prompts: list[list[int]]
    make_params: Callable[[int, int], Any]  # (group, choice index) -> SamplingParams
    n: int = 1
    emit: Callable[[tuple], None] = lambda msg: None  # thread-safe delivery to the handler
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))
    candidates: list[Candidate] = field(default_factory=list)
    cancelled: bool = False
    finalized: bool = False
    admitted_t: float | None = None
    wall: float = field(default_factory=time.time)  # arrival, wall clock: the ledger row's ts
    billed_tokens: int = 0  # completion tokens in the request's last ledger write
    billed_t: float = 0.0
    ledger_open: bool = False  # its running row has been submitted
    first_token_t: float | None = None
    source: dict = field(default_factory=dict)  # group -> the candidate that prefilled it
    # group -> the logits of its prompt's last row, from the source's prefill, while siblings have yet to start
    prompt_logits: dict = field(default_factory=dict)
    cache_salt: str | None = None  # KV rows are reused only between requests of one key and one salt

    @property
    def tenant(self) -> tuple:
        """Whose earlier requests' KV rows and text this one may reuse: its key's and salt's only."""
        return (self.principal.key_id, self.cache_salt)

    def __post_init__(self):
        i = 0
        for g, ids in enumerate(self.prompts):
            for _ in range(self.n):
                self.candidates.append(Candidate(self, i, g, ids, self.make_params(g, i)))
                i += 1


class StreamGeneration:
    """`Engine.stream` seen as a Generation (prefill / advance / take_events / done / result / close), for
    engines without `Engine.start`. One `next()` per call; done once the generator has returned."""

    def __init__(self, it):
        self._it, self._events = it, []
        self.done, self.result = False, None

    def _step(self) -> None:
        try:
            self._events.append(next(self._it))
        except StopIteration as stop:
            self.done, self.result = True, stop.value

    def prefill(self) -> None:
        self._step()

    def advance(self, logits=None, features=None) -> None:
        self._step()

    def take_events(self) -> list:
        ev, self._events = self._events, []
        return ev

    def close(self) -> None:
        self._it.close()


class ModelWorker:
    def __init__(self, name: str, path, *, max_context: int | None = None, slots: int = 4, max_queue: int = 64,
                 ultrafast_weight: int = 4, metrics: ServerMetrics, ledger: LedgerWriter, prices: PriceTable,
                 limiter: RateLimiter, device: str | None = None, warmup: bool = True, threads: int | None = None,
                 activation_bits: int = 16, drafters: list[str] | None = None, draft_model=None,
                 self_spec_layers: str | None = None, engine_factory: Callable[[], Any] | None = None,
                 draft_head: str | None = "auto", fixed_draft_k: int | None = None, tp=None):
        if slots < 1:
            raise ValueError("--slots must be at least 1")
        if max_queue < 1:
            raise ValueError("--max-queue must be at least 1")
        if fixed_draft_k is not None:
            from ..speculative import MAX_K

            if not 1 <= fixed_draft_k <= MAX_K:
                raise ValueError(f"--fixed-draft-k must be in 1..{MAX_K}, got {fixed_draft_k}")
        self.name, self.path = name, path
        self.max_context, self.n_slots, self.max_queue = max_context, slots, max_queue
        self.ultrafast_weight = max(1, ultrafast_weight)
        self.metrics, self.ledger, self.prices, self.limiter = metrics, ledger, prices, limiter
        self.device, self.warmup, self.threads = device, warmup, threads
        self.activation_bits = activation_bits
        self.drafters, self.draft_model, self.self_spec_layers = drafters, draft_model, self_spec_layers
        self.draft_head, self.fixed_draft_k = draft_head, fixed_draft_k
        self._engine_factory = engine_factory
        self.tp = tp  # `serve --tp`: this is rank 0; the other ranks follow its passes (tensor_parallel.py)
        self.engine = None
        self.logprobs_supported = False
        self._generations = self._batch = False
        self.slots: list[Slot] = []
        self.load_error: BaseException | None = None
        self.ready = threading.Event()
        self._cond = threading.Condition()
        self._pending: dict[str, deque[Candidate]] = {t: deque() for t in TIER_ORDER}
        self._pending_requests = 0
        self._cancels: list[GenRequest] = []
        self._active: list[Candidate] = []
        # the batched ultrafast candidates' probes (`_probe`): rounds since the last, and rounds between two
        self._since_probe, self._probe_wait = 0, self.BATCH_PROBE
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name=f"ultrafast-worker-{name}", daemon=True)
        metrics.slots_total.labels(name).set(slots)
        metrics.slots_in_use.labels(name).set(0)
        metrics.queue_depth.labels(name).set(0)

    # ------------------------------------------------------------------ the asyncio side

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> None:
        self.ready.wait(timeout)
        if self.load_error is not None:
            raise RuntimeError(f"model {self.name!r} failed to load: {self.load_error}") from self.load_error

    @property
    def queue_depth(self) -> int:
        return self._pending_requests

    def submit(self, req: GenRequest) -> None:
        with self._cond:
            if self._stopping or self.load_error is not None:
                raise Unavailable(f"model {self.name!r} is not serving")
            # pending requests that a free slot takes at the next round are not waiting: a burst of
            # slots + max_queue requests is accepted even before the worker has admitted any of them
            free = sum(s.owner is None for s in self.slots)
            if self._pending_requests - free >= self.max_queue:
                raise QueueFull(self.name)
            for c in req.candidates:
                self._pending[req.tier].append(c)
            self._pending_requests += 1
            self.metrics.queue_depth.labels(self.name).set(self._pending_requests)
            self._cond.notify()

    def cancel(self, req: GenRequest) -> None:
        """The client went away: stop the request at the next round (safe from any thread)."""
        with self._cond:
            if req.finalized or req.cancelled:
                return
            req.cancelled = True
            self._cancels.append(req)
            self._cond.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the worker thread

    def _load(self):
        if self._engine_factory is not None:
            return self._engine_factory()
        from ..engine import Engine

        engine = Engine.from_path(self.path, max_context=self.max_context, device=self.device,
                                  activation_bits=self.activation_bits, tp=self.tp)
        if self.tp is not None:
            engine.lead()
        if self.draft_model is not None:
            engine.attach_draft_model(Engine.from_path(self.draft_model, max_context=engine.max_context,
                                                       device=self.device, activation_bits=self.activation_bits))
        if self.self_spec_layers:
            engine.use_self_spec_layers(self.self_spec_layers)
        if self.draft_head and self.draft_head != "none":
            engine.attach_draft_head(None if self.draft_head == "auto" else self.draft_head)
        if self.drafters:
            engine.default_drafters = list(self.drafters)  # what every ultrafast request here drafts with
        engine.fixed_draft_k = self.fixed_draft_k
        return engine

    def _main(self) -> None:
        try:
            if self.threads:  # per thread: the OpenMP thread count is a property of the calling thread
                import torch

                torch.set_num_threads(self.threads)
            engine = self._load()
            self._generations = callable(getattr(engine, "start", None))
            self._batch = self._generations and callable(getattr(engine, "forward_batch", None))
            # a Generation's events carry the logprobs its sampler records; a stream-only engine's may not
            self.logprobs_supported = self._generations
            if self.warmup:
                engine.stepper("ultrafast")  # measures r(k) now rather than on the first ultrafast request
            # the engine's own cache is the first slot
            self.slots = [Slot(0, engine.cache)] + [Slot(i, engine.new_cache()) for i in range(1, self.n_slots)]
            self.engine = engine
        except BaseException as e:  # reported by wait_ready
            self.load_error = e
            self.ready.set()
            return
        self.ready.set()
        try:
            self._loop()
        except BaseException:  # a bug: fail what is in flight rather than hang the clients
            log.exception("worker %s crashed", self.name)
            with self._cond:
                self._stopping = True
            self._abort_all("the model worker crashed")
        finally:
            mirror = getattr(getattr(self.engine, "model", None), "mirror", None)
            if mirror is not None:  # serve --tp: the other ranks stop with this one
                mirror.stop()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._cancels or self._active or self._pending_requests):
                    self._cond.wait()
                if self._stopping:
                    break
                cancels, self._cancels = self._cancels, []
            for req in cancels:
                self._cancel_now(req)
            self._admit()
            self._round()
        self._abort_all("the server is shutting down", status="cancelled")

    def _abort_all(self, message: str, status: str = "failed") -> None:
        with self._cond:
            pending = [c for t in TIER_ORDER for c in self._pending[t]]
            for t in TIER_ORDER:
                self._pending[t].clear()
            self._pending_requests = 0
        reqs = {id(c.req): c.req for c in pending + self._active}
        for req in reqs.values():
            self._stop_request(req, status, message)

    # ---- admission

    def _ultrafast_cap(self) -> int:
        """Slots ultrafast candidates may hold now: all while no standard candidate waits, else all but a
        quarter (at least one left for the standard tier)."""
        if not any(not c.req.cancelled for c in self._pending["standard"]):
            return len(self.slots)
        return max(0, len(self.slots) - max(1, len(self.slots) // 4))

    def _eligible(self, c: Candidate) -> bool:
        """A sibling waits while the candidate that prefills its prompt has not done so yet."""
        src = c.req.source.get(c.group)
        return src is None or src.prefilled

    def _admit(self) -> None:
        free = [s for s in self.slots if s.owner is None]
        if not free:
            return
        admitted: list[Candidate] = []
        with self._cond:
            ultra_cap = self._ultrafast_cap()
            ultra_held = sum(s.owner is not None and s.owner.req.tier == "ultrafast" for s in self.slots)
            for tier in TIER_ORDER:
                dq = self._pending[tier]
                i = 0
                while free and i < len(dq):
                    c = dq[i]
                    if c.req.cancelled or not self._eligible(c):
                        i += 1
                        continue
                    if tier == "ultrafast":
                        if ultra_held >= ultra_cap:
                            break
                        ultra_held += 1
                    del dq[i]
                    tenant = c.req.tenant
                    slot = max(free, key=lambda s: (s.cache.reusable_prefix(c.prompt_ids) if s.tenant == tenant
                                                    else 0, -s.last_used))
                    free.remove(slot)
                    if slot.tenant != tenant:  # another tenant's rows are never reused: forget them
                        slot.cache.tokens = []
                        slot.tenant = tenant
                    slot.owner, c.slot, c.state = c, slot, "active"
                    c.req.source.setdefault(c.group, c)  # the first of its prompt prefills it
                    admitted.append(c)
                    if not any(x.state == "pending" for x in c.req.candidates):
                        self._pending_requests -= 1
            self.metrics.queue_depth.labels(self.name).set(self._pending_requests)
        now = time.monotonic()
        for c in admitted:
            req = c.req
            if c.state != "active":  # a sibling failed to start, and took the request down
                continue
            if req.admitted_t is None:
                req.admitted_t = now
                self.metrics.queue_time.labels(self.name, req.tier).observe(now - req.arrival)
            src = req.source[c.group]
            # with the source's last-row logits, all the prompt's rows (the sibling then runs no forward of its
            # own: Generation.prefill), else all but the last
            m = len(c.prompt_ids) - (c.group not in req.prompt_logits)
            if (src is not c and src.state == "active" and src.slot is not None
                    and c.slot.cache.tokens[:m] != c.prompt_ids[:m]):
                # the sibling prefilled this prompt: copy its rows instead of recomputing them
                s, d = src.slot.cache, c.slot.cache
                d.copy_rows_from(s, 0, m)
                d.tokens = list(c.prompt_ids[:m])
                self.metrics.shared_prefill.labels(self.name).inc(m)
            c.cached_tokens = c.slot.cache.reusable_prefix(c.prompt_ids)
            self._active.append(c)
            try:
                c.gen = self._start(c)
            except Exception as e:  # the handler validated the prompt; this is a bug, fail only this request
                log.exception("could not start request %s", req.id)
                self._stop_request(req, "failed", f"generation failed: {type(e).__name__}: {e}")
                continue
            if not req.ledger_open:
                self._settle(req)  # its row opens as its generation starts
        self.metrics.slots_in_use.labels(self.name).set(sum(s.owner is not None for s in self.slots))

    # ---- stepping

    def _start(self, c: Candidate):
        if not self._generations:
            return StreamGeneration(self.engine.stream(c.prompt_ids, c.params, tier=c.req.tier,
                                                       cache=c.slot.cache, scope=c.req.tenant))
        return self.engine.start(c.prompt_ids, c.params, tier=c.req.tier, cache=c.slot.cache, scope=c.req.tenant)

    def _round(self) -> None:
        live = lambda c: c.state == "active" and not c.req.cancelled  # noqa: E731
        ultra = [c for c in self._active if c.req.tier == "ultrafast"]
        ultra_live = [c for c in ultra if live(c)]
        together = self._batchable(ultra_live)
        plans = self._plans(together)  # what each would draft in the shared pass
        probe = None
        batch_rate = self._batch_rate(together, plans) if together else 0.0
        batching = bool(together) and self._batch_pays(together, batch_rate)
        # Candidates that will batch together from the next round (a request's n candidates in its first
        # rounds): the fresh ones prefill only, as they do once a batch is running, and those already prefilled
        # wait for them rather than speculate alone (n = 10: ten candidates' lone passes before the first batch)
        joinable = [] if batching else self._batchable(ultra_live, prefilled=False)
        joining = any(not c.prefilled for c in joinable) and self._batch_pays(joinable, self._batch_rate(joinable))
        waiting = {id(c) for c in joinable if c.prefilled} if joining else set()
        if batching:
            # now and then one of them speculates alone, so that drafts that start paying (text that repeats)
            # are seen (`_probe`)
            probe = self._probe(together)
            group = [c for c in together if c is not probe]
            for i in range(self.ultrafast_weight):  # the first pass takes the plans judged above
                self._batched_pass([c for c in group if live(c)], plans if i == 0 else None)
            ultra = [c for c in ultra if c not in group]
        for c in ultra:
            if id(c) in waiting:
                continue
            for _ in range(self.ultrafast_weight):
                if not live(c):
                    break
                fresh = not c.prefilled
                self._step(c)
                if fresh and (batching or joining or self._siblings_to_come(c)):
                    break  # its prefill only: it joins the batched passes next round (not three passes alone)
        if probe is not None:
            self._probed(probe, batch_rate)
        standard = [c for c in self._active if c.req.tier != "ultrafast"]
        fresh = [c for c in standard if not c.prefilled and live(c)]
        for c in fresh:
            self._step(c)  # its prefill: one forward of its own (none for a sibling given its source's logits)
        # a sibling whose prefill ran no forward joins this round's pass (else its source would step alone)
        ready = [c for c in standard if c.prefilled and live(c) and (c not in fresh or c.borrowed_prefill)]
        if self._batch and len(ready) > 1:
            self._batched_pass(ready)
        else:
            for c in ready:
                if live(c):
                    self._step(c)

    def _batched_pass(self, cands: list[Candidate], plans: dict | None = None) -> None:
        """One pass over the weights for several candidates (bit-identical to each alone). Each ultrafast one
        may add drafts to it (`Generation.draft_plan`): the pass keeps those that pay for the rows they add
        (`speculative.share_rows`), and each candidate verifies its own rows; without drafts it is the plain
        steps of all. When their steppers read the target's features (a draft head; `_batchable` groups only
        those that read the same ones), the pass returns them too and each candidate's rows go to its stepper.
        Candidates of one request whose tokens so far are the same (best-of-n samples often agree for many
        tokens: `_same_rows`) take one set of rows between them: the first of them drafts and its rows are
        computed once, the others' caches get their keys and values, and each verifies them (the first's drafts)
        with its own sampler, so each emits what it would have alone.
        plans: the candidates' plans (by id) when the round has just made them."""
        if not cands:
            return
        spec = _hidden_spec(cands[0])
        try:
            same = _same_rows(cands)
            run = [i for i, j in enumerate(same) if j is None]  # the candidates whose rows the pass computes
            by_id = plans if plans is not None else self._plans(cands)
            plans = [by_id.get(id(cands[i])) if same[i] is None else None for i in range(len(cands))]
            keep = [0] * len(cands)
            for i, k in zip(run, self._shared_rows([plans[i] for i in run], _twins(same, run))):
                keep[i] = k
            for i, j in enumerate(same):
                if j is not None:  # a twin verifies the rows of the first with the same tokens so far
                    plans[i], keep[i] = plans[j], keep[j]
            inputs = [cands[i].gen.spec_input(plans[i].drafts[:keep[i]]) if keep[i] else cands[i].gen.plain_input()
                      for i in run]
            share = _shared_prompts([cands[i] for i in run], inputs)
            out = self.engine.forward_batch(inputs, hidden=spec, share=share, all_logits=any(keep))
            for c, j, k in zip(cands, same, keep):
                if j is not None:  # the rows its twin computed: the same keys and values
                    c.gen.cache.copy_rows_from(cands[j].gen.cache, c.gen.pos, c.gen.pos + 1 + k)
        except Exception as e:
            log.exception("a batched pass failed (model %s)", self.name)
            for c in cands:
                self._stop_request(c.req, "failed", f"generation failed: {type(e).__name__}: {e}")
            return
        for tier in {c.req.tier for c in cands}:
            self.metrics.batched_rows.labels(self.name, tier).inc(sum(1 + keep[i] for i in run
                                                                      if cands[i].req.tier == tier))
        if len(run) < len(cands):
            self.metrics.same_rows.labels(self.name).inc(sum(1 + k for j, k in zip(same, keep) if j is not None))
        logits, feats = out if spec else (out, None)
        rows: dict[int, slice] = {}
        at = 0
        for i in run:
            rows[i] = slice(at, at + 1 + keep[i])
            at = rows[i].stop
        for i, (c, plan, k) in enumerate(zip(cands, plans, keep)):
            r = rows[i if same[i] is None else same[i]]
            if c.state == "active" and not c.req.cancelled:
                lg = logits[r] if plan is not None else logits[r][0]
                self._step(c, lg if same[i] is None else lg.clone(),
                           None if feats is None else feats[r.stop - 1 - k:r.stop], plan, k)

    def _shared_rows(self, plans: list, weights: list[int] | None = None) -> list[int]:
        """How many drafts of each plan a shared pass verifies (`speculative.share_rows`, each plan weighted by
        the candidates that take its rows; none before r(k) is measured)."""
        r = getattr(self.engine, "r_table", None)
        if not r or not any(p is not None and p.drafts for p in plans):
            return [0] * len(plans)
        return share_rows(plans, r, weights=weights)

    def _plans(self, cands: list[Candidate]) -> dict:
        """The candidates' plans by id; none where no draft could pay in their shared pass: where even drafts
        sure to be accepted yield fewer tokens per unit of cost than the pass's plain rows (a pass of ten rows
        on this CPU is bound by its multiplies), asking the lookups would only cost their time."""
        r = getattr(self.engine, "r_table", None)
        same = _same_rows(cands)
        run = [i for i, j in enumerate(same) if j is None]
        lead = [cands[i] for i in run]  # twins take the first one's plan
        if not r or not drafts_may_pay(len(lead), r, _twins(same, run)):
            return {}
        return {id(c): self._plan(c) for c in lead}

    def _plan(self, c: Candidate):
        """c's drafts for a shared pass (None: it has none to offer, or must not draft)."""
        plan = getattr(c.gen, "draft_plan", None)
        if plan is None or c.req.tier != "ultrafast" or c.state != "active" or c.req.cancelled:
            return None
        return plan()

    # ---- ultrafast candidates decoding together (n > 1, or several ultrafast requests)

    # batched rounds between two probes of the group (one candidate speculating alone, re-measuring its drafts):
    # BATCH_PROBE at first, after a newcomer joins and after a probe whose drafts beat the batched pass; doubled
    # up to BATCH_PROBE_MAX after each one whose drafts did not (open text)
    BATCH_PROBE, BATCH_PROBE_MAX = 8, 64

    def _batchable(self, ultra: list[Candidate], prefilled: bool = True) -> list[Candidate]:
        """The ultrafast candidates that may join a batched plain pass: prefilled (prefilled=False: or about to
        be), and reading the same target features (none, or a draft head's: the pass returns those, so a head
        keeps its context while its candidate steps in the batch). Where candidates read different features,
        the largest such group."""
        if not self._batch or self.fixed_draft_k is not None:  # a fixed draft length: every pass drafts
            return []
        groups: dict[Any, list[Candidate]] = {}
        for c in ultra:
            if (c.prefilled or not prefilled) and hasattr(c.gen, "plain_input") and hasattr(c.gen, "stepper"):
                groups.setdefault(_hidden_spec(c), []).append(c)
        out = max(groups.values(), key=len, default=[])
        return out if len(out) > 1 else []

    def _siblings_to_come(self, c: Candidate) -> bool:
        """Whether c's request still has candidates waiting for c's prefill (n > 1), which may batch with it."""
        return self._batch and any(x.state == "pending" for x in c.req.candidates)

    def _batch_rate(self, group: list[Candidate], plans: dict | None = None) -> float:
        """Expected tokens per step-time of one batched pass for the group, by the engine's measured r(k): m
        rows cost r(m) steps, and with their plans the drafts the pass would keep (`_shared_rows`) add their
        rows and their expected tokens (0.0 before r(k) is measured)."""
        r = getattr(self.engine, "r_table", None)
        if not r:
            return 0.0
        same = _same_rows(group)
        lead = [i for i, j in enumerate(same) if j is None]  # twins share the rows of the first (`_batched_pass`)
        got = [plans.get(id(group[i])) for i in lead] if plans else [None] * len(lead)
        size = _twins(same, lead)
        keep = self._shared_rows(got, size)
        tokens = len(group) + sum(n * sum(p.values[:k]) for p, k, n in zip(got, keep, size) if k)
        return tokens / batch_cost(r, len(lead) + sum(keep))

    def _batch_pays(self, group: list[Candidate], batch_rate: float) -> bool:
        """Whether one batched pass for the group, yielding `batch_rate` (`_batch_rate`, with the drafts it would
        keep), yields more tokens per unit of time than the candidates' own speculative passes do (the measured
        tokens per step-time of those that have speculated; 1.0, a plain step's, before any has)."""
        rates = [c.spec_rate for c in group if c.spec_passes]
        return batch_rate > 1.05 * (sum(rates) / len(rates) if rates else 1.0)

    def _probe(self, together: list[Candidate]) -> Candidate | None:
        """Count a batched round; when the group's probe is due, the candidate to probe: one whose last probe
        beat the batched pass (its drafts may still pay), else one never probed, else the one waiting longest.
        A probe's passes hold up every batch mate, so the group probes on one clock, not each candidate on its
        own: the n candidates of a request all fell due in the same round and probed in n rounds in a row (on
        the 1.5B, n = 10 took 1.05x the standard tier's wall-clock)."""
        for c in together:
            if c.batched_rounds == 0 and not c.probed:  # a newcomer: its drafts measured within BATCH_PROBE rounds
                self._probe_wait = min(self._probe_wait, self.BATCH_PROBE)
            c.batched_rounds += 1
        self._since_probe += 1
        if self._since_probe < self._probe_wait:
            return None
        return max(together, key=lambda c: (c.probe_won, not c.probed, c.batched_rounds))

    def _probed(self, c: Candidate, batch_rate: float) -> None:
        """After c's probe: the group waits twice as long for the next while probes yield less than the batched
        pass (up to BATCH_PROBE_MAX rounds), BATCH_PROBE again once one yields more."""
        c.batched_rounds, c.probed, self._since_probe = 0, True, 0
        c.probe_won = c.spec_rate * 1.05 >= batch_rate
        self._probe_wait = self.BATCH_PROBE if c.probe_won else min(self.BATCH_PROBE_MAX, 2 * self._probe_wait)

    def _step(self, c: Candidate, logits=None, features=None, plan=None, keep: int = 0) -> None:
        """Prefill c, or advance it one pass (its own, or its rows of a batched pass, with their features
        when its stepper reads them: its plain step's row, or with `plan` its last token's and its first `keep`
        drafts')."""
        req, g = c.req, c.gen
        try:
            if not c.prefilled:
                c.prefilled = True  # siblings may copy its rows from now on
                self._prefill(c)
            elif logits is None and req.tier == "ultrafast" and hasattr(g, "stepper"):
                stats = g.stepper.stats  # its own speculative pass: what it yields per step-time, drafting included
                emitted, spent = stats.emitted, stats.spent
                g.advance()
                if stats.spent > spent:
                    rate = (stats.emitted - emitted) / (stats.spent - spent)
                    c.spec_rate = rate if not c.spec_passes else 0.7 * c.spec_rate + 0.3 * rate
                    c.spec_passes += 1
            elif plan is not None:
                g.advance_rows(plan, keep, logits, features)
            else:
                g.advance(logits, features)
        except Exception as e:
            log.exception("generation failed (model %s, request %s)", self.name, req.id)
            self._stop_request(req, "failed", f"generation failed: {type(e).__name__}: {e}")
            return
        events = g.take_events()
        if events:
            now = time.monotonic()
            if c.first_t is None:
                c.first_t = now
                if req.first_token_t is None:
                    req.first_token_t = now
                    self.metrics.ttft.labels(self.name, req.tier).observe(now - req.arrival)
            else:
                self.metrics.itl.labels(self.name, req.tier).observe((now - c.last_t) / len(events))
            c.last_t = now
            for ev in events:
                self._event(c, ev)
        if g.done:
            self._candidate_done(c, g.result)
        elif not req.finalized:
            self._settle(req)

    def _prefill(self, c: Candidate) -> None:
        """c's prefill. A sibling starts from the logits its source computed for the prompt's last row, when the
        source kept them (its own forward of that row would give the same bits); the source keeps them while
        candidates of its prompt have yet to start."""
        req = c.req
        is_source = req.source.get(c.group) is c
        row = None if is_source else req.prompt_logits.get(c.group)
        c.borrowed_prefill = row is not None
        last = c.gen.prefill(row) if row is not None else c.gen.prefill()
        waiting = [x for x in req.candidates if x.group == c.group and x is not c
                   and (x.state == "pending" or (x.state == "active" and not x.prefilled))]
        if not waiting:
            req.prompt_logits.pop(c.group, None)
        elif is_source and last is not None:
            req.prompt_logits[c.group] = last

    def _event(self, c: Candidate, ev) -> None:
        req = c.req
        c.events += 1
        req.emit(("delta", c.index, ev.text, ev.logprobs if c.logprobs else None))

    def _release(self, c: Candidate) -> None:
        if c in self._active:
            self._active.remove(c)
        if c.slot is not None:
            c.slot.owner = None
            c.slot.last_used = time.monotonic()
            c.slot = None
        self.metrics.slots_in_use.labels(self.name).set(sum(s.owner is not None for s in self.slots))

    def _candidate_done(self, c: Candidate, result) -> None:
        req = c.req
        c.result, c.finish_reason, c.state = result, result.finish_reason, "done"
        if c.first_t is None:
            c.first_t = time.monotonic()
            if req.first_token_t is None:
                req.first_token_t = c.first_t
                self.metrics.ttft.labels(self.name, req.tier).observe(c.first_t - req.arrival)
        self._release(c)
        req.emit(("choice_done", c.index, result.finish_reason, result))
        if all(x.state == "done" for x in req.candidates):
            self._finalize(req, "finished")

    def _cancel_now(self, req: GenRequest) -> None:
        if not req.finalized:
            self._stop_request(req, "cancelled", "cancelled")

    def _stop_request(self, req: GenRequest, status: str, message: str) -> None:
        """End every candidate of req (closing generators, freeing slots), then finalize it."""
        if req.finalized:
            return
        with self._cond:
            was_pending = any(c.state == "pending" for c in req.candidates)
            for c in req.candidates:
                if c.state == "pending":
                    try:
                        self._pending[req.tier].remove(c)
                    except ValueError:
                        pass
                    c.state = "done"
            if was_pending:
                self._pending_requests = max(0, self._pending_requests - 1)
            self.metrics.queue_depth.labels(self.name).set(self._pending_requests)
        for c in req.candidates:
            if c.state == "active":
                try:
                    if c.gen is not None:
                        c.gen.close()  # the engine keeps the slot's cache truthful
                except Exception:
                    log.exception("closing a generator failed")
                c.state = "done"
                self._release(c)
        self._finalize(req, status, message)

    # ---- accounting

    def _completion_tokens(self, req: GenRequest) -> int:
        """Completion tokens to bill: a finished candidate's sampled tokens, the others' delivered ones."""
        return sum(c.completion_tokens for c in req.candidates)

    def _ledger_row(self, req: GenRequest, status: str, completion: int, now: float) -> LedgerRow:
        groups = {}
        for c in req.candidates:
            groups.setdefault(c.group, []).append(c)
        prompt_tokens = sum(len(req.prompts[g]) for g in groups)
        cached = 0
        for g in groups:
            src = req.source.get(g)
            if src is not None:
                cached += src.result.cached_tokens if src.result is not None else src.cached_tokens
        first = req.candidates[0].result
        tau = first.spec.get("tau") if first is not None and req.tier == "ultrafast" and first.spec else None
        return LedgerRow(request_id=req.id, key_id=req.principal.key_id, model=self.name, tier=req.tier,
                         endpoint=req.endpoint, n=len(req.candidates), prompt_tokens=prompt_tokens,
                         cached_tokens=cached, completion_tokens=completion,
                         cost_usd=self.prices.cost(self.name, req.tier, prompt_tokens, cached, completion),
                         queue_s=(req.admitted_t or now) - req.arrival,
                         ttft_s=(req.first_token_t - req.arrival) if req.first_token_t is not None else None,
                         total_s=now - req.arrival,
                         decode_tokens_per_s=first.decode_tokens_per_s if first is not None else None, tau=tau,
                         status=status, ts=req.wall)

    def _settle(self, req: GenRequest) -> None:
        """Open the request's running row, or rewrite it once SETTLE_TOKENS more tokens (or SETTLE_S seconds
        with new tokens) have come since the last write."""
        completion, now = self._completion_tokens(req), time.monotonic()
        new = completion - req.billed_tokens
        if req.ledger_open and new < SETTLE_TOKENS and (new == 0 or now - req.billed_t < SETTLE_S):
            return
        req.billed_tokens, req.billed_t, req.ledger_open = completion, now, True
        self._submit_row(self._ledger_row(req, "running", completion, now))

    def _submit_row(self, row: LedgerRow, then=None):
        """Hand a row to the ledger thread (and `then`, run there after it); a write that fails counts in
        ultrafast_ledger_errors."""
        fut = self.ledger.submit(row, then)
        fut.add_done_callback(lambda f: not f.cancelled() and f.exception() is not None
                              and self.metrics.ledger_errors.inc())
        return fut

    def _finalize(self, req: GenRequest, status: str, message: str | None = None) -> None:
        if req.finalized:
            return
        req.finalized = True
        req.prompt_logits.clear()
        now = time.monotonic()
        completion = self._completion_tokens(req)
        row = self._ledger_row(req, status, completion, now)
        prompt_tokens, cached, cost, tau = row.prompt_tokens, row.cached_tokens, row.cost_usd, row.tau
        first = req.candidates[0].result
        decode_tps, queue_s = row.decode_tokens_per_s, row.queue_s
        # the key's completion tokens go to the rate limiter's table on the ledger's thread: a slow database
        # never holds up the decoding thread
        fut = self._submit_row(row, then=partial(self.limiter.record, req.principal, completion))
        m = self.metrics
        m.requests.labels(self.name, req.tier, status).inc()
        m.tokens.labels(self.name, req.tier, "prompt").inc(prompt_tokens)
        m.tokens.labels(self.name, req.tier, "cached").inc(cached)
        m.tokens.labels(self.name, req.tier, "completion").inc(completion)
        m.cost.labels(self.name, req.tier).inc(cost)
        m.prefix_hits.labels(self.name).inc(cached)
        for c in req.candidates:
            if c.result is not None and req.tier == "ultrafast":
                m.observe_spec(self.name, c.result.spec)
        first_t = req.first_token_t or now
        summary = {
            "status": status, "message": message, "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "completion_tokens": completion, "cost_usd": cost,
            "time_info": {
                "queue_time": round(queue_s, 6),
                "prompt_time": round(first.ttft_s, 6) if first is not None else None,
                "completion_time": round(now - first_t, 6),
                "total_time": round(now - req.arrival, 6),
                "created": req.created,
                "decode_tokens_per_s": round(decode_tps, 2) if decode_tps is not None else None,
                "tau": tau,
                "drafters": first.spec.get("drafters") if tau is not None else None,
                "choice_tokens": [c.completion_tokens for c in sorted(req.candidates, key=lambda c: c.index)],
            },
        }
        req.emit(("done", summary, fut))


def _same_rows(cands: list[Candidate]) -> list[int | None]:
    """For a batched pass: per candidate, the first earlier one of the same request with the same tokens so far, or
    None. Both hold the same prompt (the request's `group`) and the same output, so their caches hold the same rows,
    and any rows fed after them (the next token, and drafts) are the same bits for both (rows depend only on the
    tokens before them, and the kernels are batch-invariant): the pass computes them once."""
    first: dict = {}
    same: list[int | None] = []
    for i, c in enumerate(cands):
        out = getattr(c.gen, "out_ids", None)
        if not out or not hasattr(c.gen, "plain_input"):  # (not started: no rows yet)
            same.append(None)
            continue
        j = first.setdefault((id(c.req), c.group, tuple(out), c.gen.pos), i)
        same.append(j if j != i else None)
    return same


def _twins(same: list[int | None], lead: list[int]) -> list[int]:
    """Per candidate in `lead` (those whose rows a pass computes, `_same_rows`), how many candidates take its rows:
    itself and its twins."""
    return [1 + sum(1 for j in same if j == i) for i in lead]


def _shared_prompts(cands: list[Candidate], inputs: list[tuple]) -> list | None:
    """For a batched pass: per entry, an earlier entry of the same request and prompt and the prompt rows both caches
    hold (each candidate prefilled the prompt or copied its sibling's rows, and KV rows depend only on the tokens
    before them), so that the pass reads them once (`Engine.forward_batch`); None where there is none."""
    first: dict = {}
    share: list = []
    for i, (c, (_, start, _)) in enumerate(zip(cands, inputs)):
        j = first.setdefault((id(c.req), c.group), i)
        m = min(len(c.prompt_ids) - 1, start, inputs[j][1])
        share.append((j, m) if j != i and m > 0 and cands[j].prompt_ids == c.prompt_ids else None)
    return share if any(s is not None for s in share) else None


def _hidden_spec(c: Candidate):
    """The target features c's stepper reads (`wants_hidden`: False none, True the last layer's, or a tuple of
    extra layers); the standard tier's plain stepper reads none."""
    return getattr(getattr(c.gen, "stepper", None), "wants_hidden", False)
