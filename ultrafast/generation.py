"""One request's decoding state, advanced a pass at a time.

`Engine.stream` drives a single `Generation` as a generator. A scheduler may instead drive many: it asks
each plain-stepping generation for its next input (`plain_input`), runs them all in one pass over the
weights (`Engine.forward_batch`: continuous batching) and hands each its row of logits (`advance`).
Because the packed kernels compute every row independently of the others, a request's tokens are the
same whether it ran alone or batched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .sampler import Sampler, SamplingParams


@dataclass
class StreamEvent:
    token_id: int
    text: str  # newly completed text (may be empty while a UTF-8 sequence or a possible stop string is pending)
    # with SamplingParams.logprobs: the records of the tokens this event delivers (its own token's; the final
    # event also those of tokens whose text a stop string cut), so that a stream's records are the output's
    logprobs: list = field(default_factory=list)


@dataclass
class GenerationResult:
    token_ids: list[int]  # the generated tokens, without a final EOS
    text: str
    prompt_tokens: int
    completion_tokens: int  # tokens sampled, an EOS that ended the generation included
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    ttft_s: float
    decode_s: float
    weight_bytes_per_token: int
    cached_tokens: int = 0  # prompt tokens whose KV rows were reused from the cache
    tier: str = "standard"
    spec: dict = field(default_factory=dict)  # tau, verify passes, acceptance per drafter
    logprobs: list | None = None  # with SamplingParams.logprobs: one TokenLogprob per token in token_ids
    grammar: dict = field(default_factory=dict)  # under a grammar: masks computed and the seconds they took

    @property
    def decode_tokens_per_s(self) -> float:
        # the first token comes out of the prefill; the decode rate counts the tokens after it
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return (self.prompt_tokens - self.cached_tokens) / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def achieved_gb_per_s(self) -> float:
        return self.decode_tokens_per_s * self.weight_bytes_per_token / 1e9

    def to_json(self) -> dict:
        return {
            "token_ids": self.token_ids,
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "ttft_s": round(self.ttft_s, 6),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "weight_bytes_per_token": self.weight_bytes_per_token,
            "achieved_gb_per_s": round(self.achieved_gb_per_s, 3),
            "tier": self.tier,
            **({"grammar": self.grammar} if self.grammar else {}),
            **self.spec,
        }


def _find_stop(text: str, stops: list[str], emitted: int) -> int | None:
    """Index where the earliest stop string starts in the not-yet-emitted tail of text, if any."""
    best = None
    for s in stops:
        i = text.find(s, max(0, emitted - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


class Generation:
    def __init__(self, engine, prompt_ids: list[int], params: SamplingParams, stepper, cache, tier: str):
        engine.check_prompt(prompt_ids)
        self.engine, self.prompt, self.params, self.stepper, self.cache, self.tier = \
            engine, list(prompt_ids), params, stepper, cache, tier
        self.sampler = Sampler(params, prompt_ids,
                               engine.grammars.constraint(params.grammar) if params.grammar is not None else None)
        self.eos = set() if params.ignore_eos else engine.tokenizer.eos_ids
        self.budget = min(params.max_tokens, engine.max_context - len(prompt_ids))
        self.decoder = engine.tokenizer.stream_decoder()
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.out_ids: list[int] = []
        self.text, self.emitted = "", 0  # text decoded so far; how much of it has gone out in events
        self.events: list[StreamEvent] = []
        self.lp_sent = 0  # how many tokens' logprob records have gone out in events
        self.finish: str | None = None
        self.result: GenerationResult | None = None
        self.pos = 0  # where the next fed token goes (rows below it hold prompt + output)
        self.n_sampled = 0
        self.reused = 0
        self.t0 = self.ttft = 0.0
        self._closed = False

    @property
    def done(self) -> bool:
        return self.finish is not None

    def prefill(self, prompt_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Feed the prompt (the rows the cache does not hold yet) and take the first token; returns the logits
        of the prompt's last row [V]. prompt_logits: that row as another generation of the same prompt computed
        it (best-of-n siblings). Where this cache holds the whole prompt's rows (copied from that sibling) and the
        stepper reads no features, the row is used as it is, without a forward: the very bits this generation's
        own forward of the last token would give (the rows are the same, and the kernels batch-invariant).
        Otherwise it is ignored."""
        self.t0 = time.perf_counter()
        self.stepper.begin(self.prompt)
        want = getattr(self.stepper, "wants_hidden", False)  # a draft head reads the prompt's features
        n = len(self.prompt)
        if prompt_logits is not None and not want and self.cache.tokens[:n] == self.prompt:
            self.reused = n
            self.cache.tokens = self.cache.tokens[:n]
            last = prompt_logits.reshape(-1)
        else:
            self.reused = self.cache.reusable_prefix(self.prompt)
            self.cache.tokens = self.cache.tokens[:self.reused]  # rows past this are about to be overwritten
            logits = self.engine.forward(self.prompt[self.reused:], self.reused, cache=self.cache, hidden=want)
            if want:
                logits, features = logits
            last = logits[-1]
        tok = self.sampler.sample(last)
        if want:  # (never with borrowed logits)
            self.stepper.observe(self.reused, features, self.prompt[self.reused + 1:] + [tok])
        self.pos = n
        self.ttft = time.perf_counter() - self.t0
        self._take([tok])
        return last

    def plain_input(self) -> tuple[list[int], int, object]:
        """The next plain step's input (tokens, start position, cache), for a batched pass."""
        return [self.out_ids[-1]], self.pos, self.cache

    def draft_plan(self):
        """What this generation would draft in a pass shared with others (`SpeculativeStepper.batch_plan`), or
        None where its stepper drafts only in passes of its own (the standard tier's plain stepper)."""
        plan = getattr(self.stepper, "batch_plan", None)
        if plan is None:
            return None
        return plan(self.sampler, min(self.stepper.max_k, self.budget - len(self.out_ids) - 1))

    def spec_input(self, drafts: list[int]) -> tuple[list[int], int, object]:
        """A shared pass's input for this generation: its last token and `drafts` after it (tokens, start
        position, cache); `plain_input` without drafts."""
        return [self.out_ids[-1]] + list(drafts), self.pos, self.cache

    def advance_rows(self, plan, keep: int, logits: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """One shared pass: `logits` [1 + keep, V] (and `features`, when the stepper reads them) of the rows
        `spec_input(plan.drafts[:keep])` asked for; the tokens the target emits there are taken."""
        new = self.stepper.verify_rows(plan, keep, self.pos, logits, features, self.sampler)
        self.pos += len(new)
        self._take(new)

    def advance(self, logits: torch.Tensor | None = None, features: torch.Tensor | None = None) -> None:
        """One pass: this generation's own step (plain or speculative), or the logits row a batched pass
        computed for `plain_input()`, with that row's features [1, dim] when the stepper reads them
        (`wants_hidden`: a draft head keeps its context through batched passes too)."""
        if logits is None:
            new = self.stepper.step(self.out_ids[-1], self.pos, self.sampler, self.budget - len(self.out_ids))
        else:
            new = [self.sampler.sample(logits)]
            self.stepper.stats.record_plain()
            if features is not None:
                self.stepper.observe(self.pos, features, new)
        self.pos += len(new)
        self._take(new)

    def take_events(self) -> list[StreamEvent]:
        ev, self.events = self.events, []
        return ev

    def _take(self, new: list[int]) -> None:
        p = self.params
        for tok in new:
            self.n_sampled += 1
            if tok in self.eos:
                self.finish = "stop"
                break
            self.out_ids.append(tok)
            self.text += self.decoder.push(tok)
            stop_at = _find_stop(self.text, p.stop, self.emitted)
            if stop_at is not None:
                self.text, self.finish = self.text[:stop_at], "stop"
                break
            safe = len(self.text) - self.hold if p.stop else len(self.text)
            self.events.append(StreamEvent(tok, self.text[self.emitted:safe] if safe > self.emitted else "",
                                           self._records()))
            self.emitted = max(self.emitted, safe)
            if len(self.out_ids) >= self.budget:
                self.finish = "length"
                break
        if self.finish is not None:
            self._finish()

    def _finish(self) -> None:
        self.close()
        self.stepper.end(self.prompt + self.out_ids)
        if self.finish == "length":
            self.text += self.decoder.flush()
        records = self._records()
        if len(self.text) > self.emitted or records:
            self.events.append(StreamEvent(self.out_ids[-1] if self.out_ids else -1, self.text[self.emitted:],
                                           records))
            self.emitted = len(self.text)
        self.result = GenerationResult(
            token_ids=self.out_ids, text=self.text, prompt_tokens=len(self.prompt),
            completion_tokens=self.n_sampled, finish_reason=self.finish, ttft_s=self.ttft,
            decode_s=time.perf_counter() - self.t0 - self.ttft, cached_tokens=self.reused,
            weight_bytes_per_token=self.engine.weight_bytes_per_token, tier=self.tier,
            spec=self.stepper.stats.to_json(),
            logprobs=None if self.sampler.logprobs is None else self.sampler.logprobs[:len(self.out_ids)],
            grammar={} if self.sampler.constraint is None else
            {"masks": self.sampler.constraint.masks, "mask_seconds": round(self.sampler.constraint.mask_seconds, 6)})

    def _records(self) -> list:
        """The logprob records of output tokens not yet delivered in an event (none when not recording)."""
        rec = self.sampler.logprobs
        if rec is None:
            return []
        new, self.lp_sent = rec[self.lp_sent:len(self.out_ids)], len(self.out_ids)
        return new

    def close(self) -> None:
        """Record which rows the cache now holds truthfully; safe to call early (a client went away)."""
        if not self._closed:
            self._closed = True
            self.cache.tokens = (self.prompt + self.out_ids)[:self.pos]
