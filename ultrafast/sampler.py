"""Sampling: from one position's logits to a token, the same rule in every tier.

Greedy is argmax. Otherwise the logits pass through repetition penalty, temperature, top-k, top-p and
min-p into a distribution, and one uniform number u from the request's seeded generator picks the
token by inverse CDF. Exactly one u is drawn per emitted token, so a generation is a function of
(model, prompt, params, seed): the ultrafast tier with lookup drafters, which verifies several positions per
pass, draws the same u for the same position and therefore emits the same tokens as the standard tier. With
a draft model sampling its drafts (verifier.verify_sampled) the tokens differ, their distribution does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    pass


# A penalty divides or multiplies logits: far outside this range they overflow float32 (a penalty of 1e-320
# turned every seen token's logit into inf and the distribution into NaN); no use of it needs more.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# torch.Generator takes seeds from -2**63 to 2**64 - 1; the API's seed is an int64 (the server adds the choice
# index for n > 1, which stays inside).
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1],
             f"repetition_penalty must be in [{REPETITION_PENALTY_RANGE[0]}, {REPETITION_PENALTY_RANGE[1]}]"),
            (self.seed is None or (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
             "seed must be a 64-bit integer"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
        ]
        for ok, msg in checks:
            if not ok:
                raise SamplingError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g

    def draft_generator(self) -> torch.Generator:
        """The generator a draft model samples its drafts with: seeded from `seed` too, but a stream apart
        from the request's own, which stays one uniform per emitted token."""
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed((self.seed * 0x9E3779B1 + 0x7F4A7C15) % (1 << 63))
        return g


def apply_repetition_penalty(logits: torch.Tensor, history, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on every token already seen (prompt and output), as Hugging Face applies it.
    history: token ids (a list or a tensor); only turned into a tensor when a penalty applies."""
    if penalty == 1.0 or len(history) == 0:
        return logits
    history = torch.as_tensor(history, dtype=torch.long)
    logits = logits.clone()
    seen = logits[history]
    logits[history] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] (already penalised) -> the sampling distribution [V] (float32, sums to 1)."""
    x = logits.float()
    logits = x / p.temperature
    if not bool(torch.isfinite(logits.max())):
        # a temperature so small that the top logits overflow: its limit, the mass on the top logit(s) (shifted
        # first, the top one(s) are 0 and every other one -inf)
        logits = (x - x.max()) / p.temperature
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) >= p.top_p  # keep the smallest prefix whose mass reaches top_p
        drop[0] = False  # and always the top token (a top_p below float32's range rounds to 0 here)
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse CDF: the first token whose cumulative probability exceeds u (u in [0, 1))."""
    cum = torch.cumsum(probs, dim=-1)
    idx = int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=cum.dtype), right=True))
    idx = min(idx, probs.numel() - 1)
    while probs[idx] == 0:  # never land on a token that was filtered out (rounding at the edges)
        idx -= 1
    return idx


class Sampler:
    """Per-request sampling state: the params, the seeded generator, the token history."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int]):
        self.params = params
        self.gen = None if params.greedy else params.generator()
        self._draft_gen = None
        self.history = list(prompt_ids)

    def distribution(self, logits: torch.Tensor, history: list[int] | None = None) -> torch.Tensor:
        hist = self.history if history is None else history
        logits = apply_repetition_penalty(logits, hist, self.params.repetition_penalty)
        return probabilities(logits, self.params)

    def next_uniform(self) -> float:
        return float(torch.rand(1, generator=self.gen, dtype=torch.float64))

    def draft_sample(self, logits: torch.Tensor, history: list[int]) -> tuple[int, torch.Tensor]:
        """For a draft model at temperature > 0: a token drawn from its logits under this request's transform,
        and that distribution q (verify_sampled needs both). Draws from the draft generator, not the request's."""
        if self._draft_gen is None:
            self._draft_gen = self.params.draft_generator()
        q = self.distribution(logits, history)
        return sample_from(q, float(torch.rand(1, generator=self._draft_gen, dtype=torch.float64))), q

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] for the next position -> token id; records it in the history."""
        if self.params.greedy:
            logits = apply_repetition_penalty(logits, self.history, self.params.repetition_penalty)
            tok = int(torch.argmax(logits))
        else:
            tok = sample_from(self.distribution(logits), self.next_uniform())
        self.history.append(tok)
        return tok
