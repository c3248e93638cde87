"""`ultrafast loadtest --soak`: a long run of what a service sees, checked for leaks and billing drift.

32 streaming clients (by default) for 10 minutes against a running server, each request drawn from a mix:
plain streams in the tiers of `--tier-mix`, streams with n = 2, clients that disconnect after a few tokens, and
deliberately bad requests (which must get a 4xx). It reports errors (any failure other than the expected 4xx
of a bad request), TTFT and whole-request latency p50/p99 per tier, the server's resident memory sampled over
the run and its growth, and the billing check: the ledger's totals (`/v1/usage` of the key used) against the
`/metrics` totals, both as differences over the run. Run it with a key (or in local mode) that nothing else
uses during the soak, or the two will not match.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict

from .loadtest import LoadTest, _assign_tiers, headline, percentiles_by_tier, seconds

# (body changes, what it breaks): each must be refused with a 4xx, never served or answered with a 5xx
BAD_REQUESTS = [
    ({"temperature": "hot"}, "a string temperature"),
    ({"max_tokens": -1}, "a negative max_tokens"),
    ({"model": "no-such-model"}, "an unknown model"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "an image part"),
    ({"n": 99}, "n over the limit"),
    ({"seed": 2**64}, "a seed past int64"),
    ({"messages": [{"role": "user", "content": "word " * 20000}]}, "a prompt over the context"),
]


class Soak(LoadTest):
    """LoadTest's clients, streams and report helpers, with the soak's request mix and checks."""

    SHARES = {"bad": 0.08, "disconnect": 0.08, "n2": 0.12}  # the rest: plain streams

    def __init__(self, *args, rss_every: float | None = None, **kw):
        kw.setdefault("probe_tokens", 0)
        kw.setdefault("solo_seconds", 0)
        super().__init__(*args, **kw)
        self.rss_every = rss_every or max(1.0, self.seconds / 20)

    # ---------------------------------------------------------------- the server's totals

    async def _metric_totals(self, http) -> dict:
        from prometheus_client.parser import text_string_to_metric_families

        r = await http.get("/metrics", headers=self._headers())
        r.raise_for_status()
        out = Counter()
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                if s.name == "ultrafast_requests_total":
                    out["requests"] += s.value
                elif s.name == "ultrafast_tokens_total":
                    out[f"{s.labels['kind']}_tokens"] += s.value
                elif s.name == "ultrafast_cost_usd_total":
                    out["cost_usd"] += s.value
        return dict(out)

    async def _ledger_totals(self, http) -> dict:
        r = await http.get("/v1/usage", headers=self._headers())
        r.raise_for_status()
        out = Counter()
        for row in r.json()["data"]:
            for k in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_usd"):
                out[k] += row[k]
        return dict(out)

    # ---------------------------------------------------------------- the clients

    def _kind(self, rnd: random.Random) -> str:
        x = rnd.random()
        for kind, share in self.SHARES.items():
            if x < share:
                return kind
            x -= share
        return "plain"

    async def _soak_client(self, http, i: int, tier: str, deadline: float, st: dict) -> None:
        rnd = random.Random(1000 + i)
        while time.monotonic() < deadline:
            kind = self._kind(rnd)
            body = self._request(rnd, tier)
            body["max_tokens"] = rnd.randint(8, self.max_tokens)
            try:
                if kind == "bad":
                    change, what = rnd.choice(BAD_REQUESTS)
                    r = await http.post("/v1/chat/completions", json={**body, "stream": False, **change},
                                        headers=self._headers())
                    if 400 <= r.status_code < 500 and r.status_code != 429:
                        st["bad"][r.status_code] += 1
                    else:
                        st["errors"][f"bad request ({what}) got {r.status_code}"] += 1
                    continue
                if kind == "disconnect":
                    await self._disconnect(http, body, rnd.randint(1, 4))
                    st["disconnects"] += 1
                    continue
                if kind == "n2":
                    body["n"] = 2
                t0 = time.monotonic()
                status, ttft, _, _, tokens, _ = await self._stream(http, body, deadline)
            except Exception as e:  # connection errors count as errors, the loop goes on until the deadline
                st["errors"][type(e).__name__] += 1
                await asyncio.sleep(0.1)
                continue
            if status == "cut":
                st["cut"] += 1
            elif status == 200:
                st["completed"][kind] += 1
                st["tokens"] += tokens
                if ttft is not None:
                    st["ttft"][tier].append(ttft)
                st["latency"][tier].append(time.monotonic() - t0)
            else:
                st["errors"][str(status)] += 1
                if status == 429:
                    await asyncio.sleep(0.2)

    async def _disconnect(self, http, body: dict, after: int) -> None:
        """Stream, then hang up after `after` content chunks (the server must bill what it generated)."""
        seen = 0
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=self._headers()) as r:
            if r.status_code != 200:
                await r.aread()
                raise RuntimeError(f"disconnecting client got {r.status_code}")
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    seen += 1
                    if seen >= after:
                        return

    async def _sample_rss(self, http, t0: float, deadline: float, out: list) -> None:
        while True:
            rss = await self._rss(http)
            out.append((round(time.monotonic() - t0, 1), rss))
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(self.rss_every, max(0.0, deadline - time.monotonic())))

    # ---------------------------------------------------------------- the run

    async def _run(self) -> dict:
        async with self._http() as http:
            await self._resolve_model(http)
            metrics0, ledger0 = await self._metric_totals(http), await self._ledger_totals(http)
            st = {"completed": Counter(), "errors": Counter(), "bad": Counter(), "disconnects": 0, "cut": 0,
                  "tokens": 0, "ttft": defaultdict(list), "latency": defaultdict(list)}
            tiers = _assign_tiers(self.clients, self.tier_mix)
            t0 = time.monotonic()
            deadline = t0 + self.seconds
            rss: list = []
            sampler = asyncio.create_task(self._sample_rss(http, t0, deadline, rss))
            clock = asyncio.create_task(self._clock(t0, deadline, lambda: {"done": sum(st["completed"].values()),
                                                                           "errors": sum(st["errors"].values())}))
            await asyncio.gather(*[self._soak_client(http, i, tiers[i], deadline, st) for i in range(self.clients)])
            await sampler
            clock.cancel()
            elapsed = time.monotonic() - t0
            # requests cut at the deadline close (cancelled) as the server notices: wait for both totals to agree
            settle_until = time.monotonic() + 30
            while True:
                metrics1, ledger1 = await self._metric_totals(http), await self._ledger_totals(http)
                m = {k: metrics1.get(k, 0) - metrics0.get(k, 0) for k in ledger1}
                led = {k: ledger1.get(k, 0) - ledger0.get(k, 0) for k in ledger1}
                equal = all(abs(m[k] - led[k]) <= 1e-6 * max(1.0, abs(led[k])) for k in led)
                if equal or time.monotonic() > settle_until:
                    break
                await asyncio.sleep(1.0)
        growth = None
        values = [b for _, b in rss if b]
        if len(values) >= 5:
            base = values[len(values) // 5]  # after the first fifth: KV slots, arenas and caches warmed up
            growth = round(100 * (values[-1] - base) / base, 2)
        return {
            "url": self.url, "model": self.model, "clients": self.clients, "seconds": round(elapsed, 1),
            "tier_mix": self.tier_mix, "completed": sum(st["completed"].values()),
            "completed_by_kind": dict(st["completed"]), "disconnects": st["disconnects"],
            "bad_requests": {str(k): v for k, v in st["bad"].items()}, "errors": dict(st["errors"]),
            "cut_at_deadline": st["cut"], "completion_tokens": st["tokens"],
            "tokens_per_s": round(st["tokens"] / elapsed, 2) if elapsed else None,
            "ttft": percentiles_by_tier(st["ttft"]), "latency": percentiles_by_tier(st["latency"]),
            "rss_bytes": rss, "rss_growth_pct_after_warmup": growth,
            "billing": {"ledger": led, "metrics": m, "equal": equal},
        }

    @staticmethod
    def format(r: dict) -> str:
        s = seconds
        lines = [headline("soak", r),
                 f"requests completed: {r['completed']} {r['completed_by_kind']}   disconnects: {r['disconnects']}   "
                 f"cut at the deadline: {r['cut_at_deadline']}",
                 f"deliberate bad requests refused: {sum(r['bad_requests'].values())} {r['bad_requests']}",
                 f"errors: {sum(r['errors'].values())} {r['errors'] or ''}",
                 f"completion tokens: {r['completion_tokens']} ({r['tokens_per_s']} tok/s aggregate)"]
        for tier in sorted(r["latency"]):
            t, lat = r["ttft"].get(tier, {}), r["latency"][tier]
            lines.append(f"{tier}: TTFT p50 {s(t.get('p50_s'))}, p99 {s(t.get('p99_s'))}; request p50 "
                         f"{s(lat['p50_s'])}, p99 {s(lat['p99_s'])} over {lat['n']} requests")
        rss = [(t, b) for t, b in r["rss_bytes"] if b]
        if rss:
            lines.append("server RSS (MB) over time: " + ", ".join(f"{t:.0f}s {b / 1e6:.0f}" for t, b in rss))
            lines.append(f"RSS growth after the first fifth: {r['rss_growth_pct_after_warmup']}%")
        b = r["billing"]
        lines.append(f"billing over the run, ledger vs /metrics: {'equal' if b['equal'] else 'DIFFERENT'}: "
                     + ", ".join(f"{k} {b['ledger'][k]:.6g} / {b['metrics'].get(k, 0):.6g}" for k in b["ledger"]))
        return "\n".join(lines)
