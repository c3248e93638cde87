"""Per-token logprobs for `logprobs` / `top_logprobs`.

The engine's StreamEvents carry no logits, so the server records them from inside the sampler:
`RecordingParams` (a SamplingParams with a `record` list and how many alternatives to keep) and
`RecordingSampler` (a Sampler that notes the log-softmax of every position it samples, then returns the
very token the base class returns, drawing the same random numbers).

With an engine that exposes `Engine.start`, the scheduler sets `generation.sampler` to a RecordingSampler
before the prefill. For an engine with only `Engine.stream` (which builds its own `Sampler(params,
prompt_ids)`), `install()` points the engine module's `Sampler` name at RecordingSampler; for ordinary
SamplingParams it behaves as the base class exactly.

Logprobs are those of the model's own distribution (log-softmax of the raw logits, before temperature,
top-p and repetition penalty), as OpenAI reports them. Samples are recorded in order, one per emitted
position: the i-th record is the i-th generated token, in both tiers (the speculative tier samples
the positions it verifies in order and emits every token it samples).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .. import engine as _engine_module
from ..sampler import Sampler, SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class RecordingParams(SamplingParams):
    top_logprobs: int = 0
    record: list = field(default_factory=list, repr=False, compare=False)


class RecordingSampler(Sampler):
    def __init__(self, params: SamplingParams, prompt_ids: list[int]):
        super().__init__(params, prompt_ids)
        self._record = params.record if isinstance(params, RecordingParams) else None

    def sample(self, logits: torch.Tensor) -> int:
        tok = super().sample(logits)
        if self._record is not None:
            lp = torch.log_softmax(logits.float().reshape(-1), dim=-1)
            k = self.params.top_logprobs
            top = []
            if k:
                vals, idx = torch.topk(lp, k)
                top = [(int(i), float(v)) for i, v in zip(idx, vals)]
            self._record.append(TokenLogprob(tok, float(lp[tok]), top))
        return tok


_lock = threading.Lock()


def install() -> bool:
    """Point `ultrafast.engine.Sampler` at RecordingSampler (idempotent). False when the engine no longer
    builds its sampler that way: the server then refuses logprobs instead of returning empty ones."""
    with _lock:
        current = getattr(_engine_module, "Sampler", None)
        if isinstance(current, type) and issubclass(current, RecordingSampler):
            return True
        if current is not Sampler:
            return False
        _engine_module.Sampler = RecordingSampler
        return True
