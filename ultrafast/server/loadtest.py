"""`ultrafast loadtest`: N concurrent streaming clients against a running server for a bounded time.

It reports requests completed, errors by status, p50/p99 TTFT per tier, aggregate completion tokens/s,
what one client alone gets from the same server just before the load (the same requests, one after another,
whole) and the aggregate's multiple of it (what batching buys), the server's resident memory (from /metrics)
at start and end, and an ultrafast request's decode tokens/s alone and under the load, with their ratio (the
probe runs once before, unmeasured, so that both measurements see the same drafter state). Meant for
loopback; every loop stops at the deadline. Requests still running at the deadline are cut and their tokens
not counted, so the aggregate (and the multiple) err low.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ..report import Progress

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that counts orders per customer.",
    "Give three tips for writing readable code.",
    "Write a bash one-liner that counts lines in all .py files.",
    "What does the Python keyword 'yield' do?",
    "Write a JavaScript function that debounces another function.",
    "List the HTTP methods and what each is for.",
]

PROBE_PROMPT = ("Copy this Python code exactly, then stop:\n\n"
                "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
                "def fact(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r\n")


def parse_tier_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, _, share = part.partition("=")
        name = name.strip()
        if name not in ("standard", "ultrafast", "auto"):
            raise ValueError(f"--tier-mix: unknown tier {name!r}")
        try:
            mix[name] = float(share) if share else 1.0
        except ValueError:
            raise ValueError(f"--tier-mix: {part!r} is not tier=share") from None
        if mix[name] < 0:
            raise ValueError("--tier-mix: shares must be >= 0")
    if not mix or sum(mix.values()) <= 0:
        raise ValueError("--tier-mix needs at least one tier with a positive share")
    total = sum(mix.values())
    return {k: v / total for k, v in mix.items()}


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def percentiles_by_tier(samples: dict[str, list[float]]) -> dict[str, dict]:
    """{tier: seconds} -> {tier: {n, p50_s, p99_s}}."""
    return {t: {"n": len(v), "p50_s": percentile(v, 50), "p99_s": percentile(v, 99)} for t, v in samples.items()}


def seconds(x: float | None) -> str:
    return f"{x:.3f} s" if x is not None else "-"


def headline(what: str, r: dict) -> str:
    """The first line of a report: what ran, against what."""
    return (f"{what}: {r['clients']} streaming clients for {r['seconds']} s against {r['url']} (model {r['model']}, "
            f"tiers {', '.join(f'{k}={v:.2f}' for k, v in r['tier_mix'].items())})")


def _assign_tiers(n: int, mix: dict[str, float]) -> list[str]:
    out = []
    for tier, share in mix.items():
        out += [tier] * round(share * n)
    while len(out) < n:
        out.append(max(mix, key=mix.get))
    return out[:n]


@dataclass
class _Stats:
    completed: int = 0
    cut: int = 0
    errors: Counter = field(default_factory=Counter)
    ttft: dict = field(default_factory=lambda: defaultdict(list))
    tokens: int = 0


class LoadTest:
    def __init__(self, url: str = "http://127.0.0.1:8000", clients: int = 32, seconds: float = 30,
                 model: str | None = None, tier_mix: dict[str, float] | None = None, max_tokens: int = 64,
                 api_key: str | None = None, probe_tokens: int = 96, solo_seconds: float = 10):
        if clients < 1 or seconds <= 0 or solo_seconds < 0:
            raise ValueError("--clients must be >= 1, --seconds > 0 and --solo-seconds >= 0")
        self.url, self.clients, self.seconds, self.model = url.rstrip("/"), clients, seconds, model
        self.tier_mix = tier_mix or {"standard": 1.0}
        self.max_tokens, self.api_key, self.probe_tokens = max_tokens, api_key, probe_tokens
        self.solo_seconds = solo_seconds

    def run(self) -> dict:
        import httpx

        try:
            return asyncio.run(self._run())
        except httpx.TransportError as e:  # no server there (the clients' own errors are counted, not raised)
            raise ValueError(f"cannot reach the server at {self.url}: {e}") from e
        except httpx.HTTPStatusError as e:
            raise ValueError(f"{self.url}: HTTP {e.response.status_code} for {e.request.url.path}") from e

    def _http(self):
        """The clients' connection pool: one connection per client, and a few for the probes."""
        import httpx

        limits = httpx.Limits(max_connections=self.clients + 8, max_keepalive_connections=self.clients + 8)
        return httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(600.0), limits=limits)

    async def _resolve_model(self, http) -> None:
        """No --model: the server's first."""
        if self.model is None:
            r = await http.get("/v1/models", headers=self._headers())
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _rss(self, http) -> int | None:
        try:
            r = await http.get("/metrics", headers=self._headers())
            for line in r.text.splitlines():
                if line.startswith("process_resident_memory_bytes "):
                    return int(float(line.split()[1]))
        except Exception:
            return None
        return None

    async def _stream(self, http, body: dict, deadline: float | None):
        """One streaming chat request: (status, ttft_s, first_t, last_t, completion tokens, time_info)."""
        t0 = time.monotonic()
        first = last = None
        usage, time_info = None, None
        chunks = 0

        async def go():
            nonlocal first, last, usage, time_info, chunks
            async with http.stream("POST", "/v1/chat/completions", json=body, headers=self._headers()) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        return 500
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if obj.get("time_info"):
                        time_info = obj["time_info"]
                    for ch in obj.get("choices", []):
                        if ch.get("delta", {}).get("content"):
                            now = time.monotonic()
                            first = first or now
                            last = now
                            chunks += 1
                return 200

        if deadline is None:
            status = await go()
        else:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "cut", None, None, None, 0, None
            try:
                status = await asyncio.wait_for(go(), remaining)
            except asyncio.TimeoutError:
                return "cut", None, None, None, chunks, None
        tokens = usage["completion_tokens"] if usage else chunks
        return status, (first - t0) if first else None, first, last, tokens, time_info

    def _request(self, rnd: random.Random, tier: str) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": rnd.choice(PROMPTS)}],
                "max_tokens": self.max_tokens, "temperature": 0.7, "seed": rnd.randrange(1 << 30),
                "stream": True, "stream_options": {"include_usage": True}, "service_tier": tier}

    async def _client(self, http, i: int, tier: str, deadline: float, stats: _Stats) -> None:
        rnd = random.Random(i)
        while time.monotonic() < deadline:
            body = self._request(rnd, tier)
            try:
                status, ttft, _, _, tokens, _ = await self._stream(http, body, deadline)
            except Exception as e:  # connection errors count as errors, the loop goes on until the deadline
                stats.errors[type(e).__name__] += 1
                await asyncio.sleep(0.1)
                continue
            if status == "cut":
                stats.cut += 1
            elif status == 200:
                stats.completed += 1
                stats.tokens += tokens
                if ttft is not None:
                    stats.ttft[tier].append(ttft)
            else:
                stats.errors[str(status)] += 1
                if status == 429:
                    await asyncio.sleep(0.2)

    async def _solo(self, http, tier: str) -> dict:
        """Client 0's requests, one at a time and each run whole, until solo_seconds have passed: what one
        client alone gets."""
        rnd = random.Random(0)
        t0 = time.monotonic()
        tokens = requests = 0
        while time.monotonic() - t0 < self.solo_seconds:
            try:
                status, _, _, _, n, _ = await self._stream(http, self._request(rnd, tier), None)
            except Exception as e:  # a connection error ends the baseline, as a status does; the load still runs
                return {"error": type(e).__name__}
            if status != 200:
                return {"error": status}
            tokens, requests = tokens + n, requests + 1
        elapsed = time.monotonic() - t0
        return {"tier": tier, "requests": requests, "completion_tokens": tokens, "seconds": round(elapsed, 2),
                "tokens_per_s": round(tokens / elapsed, 2) if elapsed > 0 else None}

    async def _clock(self, t0: float, deadline: float, figures) -> None:
        """A progress bar over the run's seconds (with the ETA), its postfix `figures()`, until cancelled."""
        total = max(1, round(deadline - t0))
        with Progress(total, "load", "s") as bar:
            done = 0
            try:
                while done < total:
                    await asyncio.sleep(1.0)
                    now = min(total, int(time.monotonic() - t0))
                    bar.update(now - done, **figures())
                    done = now
            except asyncio.CancelledError:
                pass

    async def _probe(self, http) -> dict:
        body = {"model": self.model, "messages": [{"role": "user", "content": PROBE_PROMPT}],
                "max_tokens": self.probe_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "service_tier": "ultrafast"}
        status, ttft, first, last, tokens, info = await self._stream(http, body, None)
        if status != 200:
            return {"error": status}
        tps = (tokens - 1) / (last - first) if first and last and last > first and tokens > 1 else None
        return {"tokens": tokens, "ttft_s": ttft, "tokens_per_s": tps,
                "server_decode_tokens_per_s": (info or {}).get("decode_tokens_per_s"), "tau": (info or {}).get("tau")}

    async def _run(self) -> dict:
        async with self._http() as http:
            await self._resolve_model(http)
            rss_start = await self._rss(http)
            probe_alone = None
            if self.probe_tokens > 0:
                # once to warm up (the suffix drafter learns from earlier requests), then measured, so that
                # alone and under load run with the same drafter state
                await self._probe(http)
                probe_alone = await self._probe(http)
            tiers = _assign_tiers(self.clients, self.tier_mix)
            solo = await self._solo(http, tiers[0]) if self.solo_seconds > 0 else None
            stats = _Stats()
            t0 = time.monotonic()
            deadline = t0 + self.seconds
            tasks = [asyncio.create_task(self._client(http, i, tiers[i], deadline, stats))
                     for i in range(self.clients)]
            clock = asyncio.create_task(self._clock(t0, deadline, lambda: {"done": stats.completed,
                                                                           "tokens": stats.tokens}))
            probe_load = None
            if self.probe_tokens > 0:
                await asyncio.sleep(min(self.seconds * 0.25, 5.0))  # let the load build up
                probe_load = await self._probe(http)
            await asyncio.gather(*tasks)
            elapsed = time.monotonic() - t0
            clock.cancel()
            rss_end = await self._rss(http)
        ratio = None
        if probe_alone and probe_load and probe_alone.get("tokens_per_s") and probe_load.get("tokens_per_s"):
            ratio = probe_load["tokens_per_s"] / probe_alone["tokens_per_s"]
        tps = round(stats.tokens / elapsed, 2) if elapsed else None
        scaling = None
        if solo and solo.get("tokens_per_s") and tps is not None:
            scaling = round(tps / solo["tokens_per_s"], 2)
        return {
            "url": self.url, "model": self.model, "clients": self.clients, "seconds": round(elapsed, 2),
            "tier_mix": self.tier_mix, "completed": stats.completed, "cut_at_deadline": stats.cut,
            "errors": dict(stats.errors), "completion_tokens": stats.tokens,
            "tokens_per_s": tps, "one_client_alone": solo, "aggregate_over_one_client": scaling,
            "ttft": percentiles_by_tier(stats.ttft),
            "rss_bytes": {"start": rss_start, "end": rss_end},
            "ultrafast_probe": {"alone": probe_alone, "under_load": probe_load, "ratio": ratio},
        }

    @staticmethod
    def format(r: dict) -> str:
        s = seconds
        lines = [headline("loadtest", r),
                 f"requests completed: {r['completed']}   errors: {sum(r['errors'].values())} {r['errors'] or ''}   "
                 f"cut at the deadline: {r['cut_at_deadline']}",
                 f"completion tokens: {r['completion_tokens']} ({r['tokens_per_s']} tok/s aggregate)"]
        solo = r.get("one_client_alone")
        if solo:
            if "error" in solo:
                lines.append(f"one client alone: error {solo['error']}")
            else:
                mult = r["aggregate_over_one_client"]
                lines.append(f"one client alone ({solo['tier']}, just before): {solo['tokens_per_s']} tok/s over "
                             f"{solo['requests']} requests; aggregate / one client: "
                             f"{f'{mult:.2f}x' if mult is not None else '-'}")
        for tier, t in sorted(r["ttft"].items()):
            lines.append(f"TTFT {tier}: p50 {s(t['p50_s'])}, p99 {s(t['p99_s'])} over {t['n']} requests")
        rss = r["rss_bytes"]
        if rss["start"] is not None and rss["end"] is not None:
            lines.append(f"server RSS: start {rss['start'] / 1e6:.0f} MB, end {rss['end'] / 1e6:.0f} MB "
                         f"({(rss['end'] - rss['start']) / 1e6:+.0f} MB)")
        p = r["ultrafast_probe"]

        def tps(x):
            if not x:
                return "-"
            if "error" in x:
                return f"error {x['error']}"
            tau = f", tau {x['tau']:.2f}" if x.get("tau") else ""
            return f"{x['tokens_per_s']:.1f} tok/s{tau}" if x.get("tokens_per_s") else "-"

        if p["alone"] is not None:
            ratio = f"{p['ratio']:.2f}" if p["ratio"] is not None else "-"
            lines.append(f"ultrafast request: alone {tps(p['alone'])}; under the load {tps(p['under_load'])}; "
                         f"ratio {ratio}")
        return "\n".join(lines)
