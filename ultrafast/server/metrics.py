"""Prometheus metrics, in a registry that belongs to one app (no module-level mutable state).

Exposed at `/metrics`: requests by model/tier/status, HTTP errors by status, tokens by kind and tier, billed $,
TTFT, queue time and inter-token latency histograms per tier, queue depth, KV slots in use,
speculative acceptance (drafted/accepted counters) and tau per request, plus the process collector
(`process_resident_memory_bytes`, CPU seconds, ...).
"""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, generate_latest,
                               CONTENT_TYPE_LATEST, GCCollector, PlatformCollector, ProcessCollector)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5)
TAU_BUCKETS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8, 12, 17)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = True):
        r = self.registry = registry or CollectorRegistry(auto_describe=True)
        if process:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)
        self.requests = Counter("ultrafast_requests", "Requests that ended, by model, tier and status",
                                ["model", "tier", "status"], registry=r)
        self.http_errors = Counter("ultrafast_http_errors", "Error responses by status code and error code",
                                   ["status", "code"], registry=r)
        self.tokens = Counter("ultrafast_tokens", "Tokens by kind (prompt, cached, completion), model and tier",
                              ["model", "tier", "kind"], registry=r)
        self.cost = Counter("ultrafast_cost_usd", "Billed dollars by model and tier (the ledger's sum)",
                            ["model", "tier"], registry=r)
        self.ttft = Histogram("ultrafast_ttft_seconds", "Time from arrival to the first token (queue + prefill)",
                              ["model", "tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("ultrafast_queue_seconds", "Time from arrival to a KV slot",
                                    ["model", "tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ultrafast_inter_token_seconds", "Time between consecutive tokens of a candidate",
                             ["model", "tier"], buckets=ITL_BUCKETS, registry=r)
        self.queue_depth = Gauge("ultrafast_queue_depth", "Requests waiting for a KV slot", ["model"], registry=r)
        self.slots_in_use = Gauge("ultrafast_kv_slots_in_use", "KV cache slots generating", ["model"], registry=r)
        self.slots_total = Gauge("ultrafast_kv_slots", "KV cache slots", ["model"], registry=r)
        self.tau = Histogram("ultrafast_spec_tau", "Tokens per pass over the weights, per ultrafast candidate",
                             ["model"], buckets=TAU_BUCKETS, registry=r)
        self.drafted = Counter("ultrafast_spec_drafted_tokens", "Draft tokens verified (ultrafast)", ["model"],
                               registry=r)
        self.accepted = Counter("ultrafast_spec_accepted_tokens", "Draft tokens accepted (ultrafast)", ["model"],
                                registry=r)
        self.prefix_hits = Counter("ultrafast_prefix_cache_tokens", "Prompt tokens served from a KV slot's prefix",
                                   ["model"], registry=r)
        self.shared_prefill = Counter("ultrafast_shared_prefill_tokens",
                                      "Prompt rows copied from a sibling candidate's slot (n > 1) instead of computed",
                                      ["model"], registry=r)
        self.batched_rows = Counter("ultrafast_batched_pass_rows",
                                    "Rows of batched passes (several candidates' plain steps in one pass over the "
                                    "weights), by model and tier", ["model", "tier"], registry=r)
        self.same_rows = Counter("ultrafast_batched_pass_same_rows",
                                 "Rows a batched pass did not compute: a candidate took those of another candidate "
                                 "of its request with the same tokens so far", ["model"], registry=r)
        self.ledger_errors = Counter("ultrafast_ledger_errors", "Ledger rows that could not be written", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_spec(self, model: str, spec: dict) -> None:
        if not spec or not spec.get("drafters"):
            return
        if spec.get("verify_passes"):
            self.tau.labels(model).observe(spec.get("tau", 0.0))
        for d in spec["drafters"].values():
            self.drafted.labels(model).inc(d.get("drafted", 0))
            self.accepted.labels(model).inc(d.get("accepted", 0))
