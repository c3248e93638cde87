"""The engine: a loaded model, its tokenizer and KV cache, and the generation loop with its measurements."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from . import kernels
from .kv_cache import KVCache
from .loader import LoadedModel, load
from .model import Transformer, build_model
from .packed import apply_packed
from .drafters import build_drafters
from .drafters.suffix import SuffixCache
from .sampler import Sampler, SamplingParams
from .speculative import PlainStepper, SpeculativeStepper, measure_r
from .tokenizer import Tokenizer

DEFAULT_MAX_CONTEXT = 4096


class ContextOverflowError(ValueError):
    pass


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

    @property
    def decode_tokens_per_s(self) -> float:
        # the first token comes out of the prefill; the decode rate counts the tokens after it
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

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
            **self.spec,
        }


@dataclass
class StreamEvent:
    token_id: int
    text: str  # newly completed text (may be empty while a UTF-8 sequence or a possible stop string is pending)


class Engine:
    def __init__(self, loaded: LoadedModel, model: Transformer, *, max_context: int | None = None, device="cpu"):
        self.loaded, self.model, self.device = loaded, model, torch.device(device)
        self.config = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.max_context = min(max_context or DEFAULT_MAX_CONTEXT, self.config.context_length)
        self.cache = KVCache(self.config, self.max_context, device=self.device)
        self.weight_bytes_per_token = model.weight_bytes_per_token()
        # the ultrafast tier's state, kept per engine (never module-global)
        self.r_table: list[float] | None = None  # measured r(k), on first ultrafast use
        self.suffix_cache = SuffixCache()  # earlier requests' tokens, for suffix decoding
        self.draft_engine: "Engine | None" = None
        self.default_drafters = ["suffix", "prompt_lookup"]

    def attach_draft_model(self, draft: "Engine") -> None:
        if draft.tokenizer.vocab_size > self.config.vocab_size + 1024 or \
                draft.tokenizer.encode("def f(x):\n    return x") != self.tokenizer.encode("def f(x):\n    return x"):
            raise ValueError("the draft model must share the target's tokenizer")
        self.draft_engine = draft
        self.default_drafters = ["suffix", "prompt_lookup", "draft_model"]

    @classmethod
    def from_path(cls, path: str | Path, *, max_context: int | None = None, device: str | None = None,
                  packed: bool | None = None) -> "Engine":
        """packed: keep weights packed and use the batch-invariant CPU kernels (default on CPU when they build);
        False is the reference path (weights dequantized to fp32 `nn.Linear`, PyTorch ops)."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        loaded = load(path)
        if packed is None:
            packed = device == "cpu" and kernels.available()
        transform = apply_packed if packed else None
        return cls(loaded, build_model(loaded, device, transform), max_context=max_context, device=device)

    def describe(self) -> dict:
        c = self.config
        return {
            "model": str(self.loaded.path),
            "arch": c.arch,
            "layers": c.n_layers,
            "dim": c.dim,
            "file_tensor_bytes": self.loaded.file_tensor_bytes,
            "weight_bytes_held": self.model.weight_bytes_held(),
            "weight_bytes_per_token": self.weight_bytes_per_token,
            "max_context": self.max_context,
            "kv_cache_bytes": self.cache.nbytes,
            "device": str(self.device),
            "kernels": self.kernels_in_use(),
        }

    def kernels_in_use(self) -> str:
        from .packed import FusedBlock, PackedLinear

        if any(isinstance(m, PackedLinear) for m in self.model.modules()):
            fused = "fused layers" if isinstance(self.model.layers[0], FusedBlock) else "per-op"
            return f"packed, {fused}, " + ("avx512" if kernels.avx512_active() else "scalar")
        return "reference (fp32 nn.Linear)"

    # ---------------------------------------------------------------- prompts

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_bos=False)

    def raw_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    # ---------------------------------------------------------------- generation

    def new_cache(self) -> KVCache:
        return KVCache(self.config, self.max_context, device=self.device)

    def _forward(self, tokens: list[int], start_pos: int, all_logits: bool = False,
                 cache: KVCache | None = None) -> torch.Tensor:
        t = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.model(t, start_pos, cache or self.cache, all_logits=all_logits)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ContextOverflowError(
                f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_context} tokens "
                f"(at least one token must be left to generate; see --max-context)")
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.config.vocab_size}): {bad[:5]}")

    def stepper(self, tier: str = "standard", drafters: list[str] | None = None, cache: KVCache | None = None):
        """The decoding loop's step for a tier: plain, or speculative with the given drafters."""
        cache = cache or self.cache
        if tier == "standard":
            return PlainStepper(self, cache)
        if tier != "ultrafast":
            raise ValueError(f"unknown tier {tier!r}: standard or ultrafast")
        if self.r_table is None:
            self.r_table = measure_r(self)
        names = drafters or self.default_drafters
        objs = build_drafters(names, suffix_cache=self.suffix_cache, draft_engine=self.draft_engine)
        return SpeculativeStepper(self, cache, objs, self.r_table)

    def stream(self, prompt_ids: list[int], params: SamplingParams, *, tier: str = "standard",
               drafters: list[str] | None = None, cache: KVCache | None = None) -> Iterator[StreamEvent]:
        """Yield tokens as they are generated; the final GenerationResult is the generator's return value.

        `cache` (default: the engine's own) is the KV cache slot to run in; rows it already holds for a prefix
        of the prompt are reused."""
        self.check_prompt(prompt_ids)
        cache = cache or self.cache
        stepper = self.stepper(tier, drafters, cache)
        sampler = Sampler(params, prompt_ids)
        eos = set() if params.ignore_eos else self.tokenizer.eos_ids
        budget = min(params.max_tokens, self.max_context - len(prompt_ids))
        decoder = self.tokenizer.stream_decoder()
        out_ids: list[int] = []
        text, emitted = "", 0  # text decoded so far; how much of it has been yielded
        hold = max((len(s) for s in params.stop), default=1) - 1
        finish = None
        t0 = time.perf_counter()
        stepper.begin(prompt_ids)
        reused = cache.reusable_prefix(prompt_ids)
        cache.tokens = cache.tokens[:reused]  # rows past this are about to be overwritten
        pos, n_sampled = len(prompt_ids), 0
        try:
            new = [sampler.sample(self._forward(prompt_ids[reused:], reused, cache=cache)[-1])]
            ttft = time.perf_counter() - t0
            while finish is None:
                for tok in new:
                    n_sampled += 1
                    if tok in eos:
                        finish = "stop"
                        break
                    out_ids.append(tok)
                    text += decoder.push(tok)
                    stop_at = _find_stop(text, params.stop, emitted)
                    if stop_at is not None:
                        text, finish = text[:stop_at], "stop"
                        break
                    safe = len(text) - hold if params.stop else len(text)
                    yield StreamEvent(tok, text[emitted:safe] if safe > emitted else "")
                    emitted = max(emitted, safe)
                    if len(out_ids) >= budget:
                        finish = "length"
                        break
                if finish is None:
                    new = stepper.step(out_ids[-1], pos, sampler, budget - len(out_ids))
                    pos += len(new)
        finally:  # also when the consumer stops early (a client that disconnects): the cache stays truthful
            cache.tokens = (list(prompt_ids) + out_ids)[:pos]
        stepper.end(list(prompt_ids) + out_ids)
        if finish == "length":
            text += decoder.flush()
        if len(text) > emitted:
            yield StreamEvent(out_ids[-1] if out_ids else -1, text[emitted:])
        decode_s = time.perf_counter() - t0 - ttft
        return GenerationResult(
            token_ids=out_ids, text=text, prompt_tokens=len(prompt_ids), completion_tokens=n_sampled,
            finish_reason=finish, ttft_s=ttft, decode_s=decode_s, cached_tokens=reused,
            weight_bytes_per_token=self.weight_bytes_per_token, tier=tier, spec=stepper.stats.to_json())

    def generate(self, prompt_ids: list[int], params: SamplingParams, **tier) -> GenerationResult:
        it = self.stream(prompt_ids, params, **tier)
        while True:
            try:
                next(it)
            except StopIteration as done:
                return done.value


def _find_stop(text: str, stops: list[str], emitted: int) -> int | None:
    """Index where the earliest stop string starts in the not-yet-emitted tail of text, if any."""
    best = None
    for s in stops:
        i = text.find(s, max(0, emitted - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
