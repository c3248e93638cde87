"""Sampling: from one position's logits to a token, the same rule in every tier.

Greedy is argmax of the adjusted logits. The logits are adjusted by `logit_bias`, the repetition penalty
(Hugging Face's, over prompt and output) and the presence and frequency penalties (OpenAI's, over the output so
far, as vLLM applies them); otherwise they pass through temperature, top-k, top-p and min-p into a distribution, and one uniform number u from the request's seeded generator picks the
token by inverse CDF. Exactly one u is drawn per emitted token, in order, so a generation is a function of
(model, prompt, params, seed), whichever tier runs it and whatever drafts it verifies.

A drafter that samples (a draft model, self-speculation) samples its draft for the position i ahead by inverse
CDF of its own distribution with the very u the target will draw there (`Sampler.draft`: peeked, not
consumed); the target then keeps the draft exactly when its own sample there equals it. Close distributions
pick the same token from the same u, so sampled drafts are accepted often, and the emitted tokens are the
standard tier's, token for token.

When asked (`SamplingParams.logprobs`), the sampler records the log-probability of every token it emits (and
the top alternatives) under the model's own distribution: the log-softmax of the raw logits, before penalty,
temperature and truncation, as OpenAI reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import kernels
from .grammar import Grammar


class SamplingError(ValueError):
    pass


# A penalty divides or multiplies logits: far outside this range they overflow float32 (a penalty of 1e-320
# turned every seen token's logit into inf and the distribution into NaN); no use of it needs more.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# torch.Generator takes seeds from -2**63 to 2**64 - 1; the API's seed is an int64 (the server adds the choice
# index for n > 1, which stays inside).
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties, OpenAI's range
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # record each emitted token's logprob and this many alternatives; None: off
    grammar: Grammar | None = None  # a grammar.Grammar the output must match (constrained decoding); None: free

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1],
             f"repetition_penalty must be in [{REPETITION_PENALTY_RANGE[0]}, {REPETITION_PENALTY_RANGE[1]}]"),
            (PENALTY_RANGE[0] <= self.presence_penalty <= PENALTY_RANGE[1],
             f"presence_penalty must be in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}]"),
            (PENALTY_RANGE[0] <= self.frequency_penalty <= PENALTY_RANGE[1],
             f"frequency_penalty must be in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}]"),
            (not self.logit_bias or all(isinstance(t, int) and t >= 0 and
                                        LOGIT_BIAS_RANGE[0] <= b <= LOGIT_BIAS_RANGE[1]
                                        for t, b in self.logit_bias.items()),
             f"logit_bias maps token ids to values in [{LOGIT_BIAS_RANGE[0]}, {LOGIT_BIAS_RANGE[1]}]"),
            (self.seed is None or (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
             "seed must be a 64-bit integer"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"logprobs (alternatives per token) must be in [0, {MAX_TOP_LOGPROBS}]"),
            (self.grammar is None or isinstance(self.grammar, Grammar), "grammar must be a grammar.Grammar"),
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


def adjust_logits(logits: torch.Tensor, history, n_prompt: int, p: SamplingParams) -> torch.Tensor:
    """logits [V] -> with logit_bias, the repetition penalty (over history) and the presence and frequency
    penalties (over history[n_prompt:], the output so far). The same for the target and for a drafter."""
    if p.logit_bias:
        logits = logits.clone()
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    logits = apply_repetition_penalty(logits, history, p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and len(history) > n_prompt:
        out = torch.as_tensor(list(history[n_prompt:]), dtype=torch.long)
        counts = torch.bincount(out, minlength=logits.numel())[:logits.numel()].to(logits.dtype)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
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
        probs = nucleus(probs, p.top_p)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p: keep the smallest set of most likely tokens whose mass reaches top_p (always the top token; a
    tie at the set's edge keeps every token of that probability). The set is found among the top 64 tokens,
    then 512, ... (a full sort of a 152k vocabulary took 17 ms a token, ten candidates 0.17 s a step)."""
    n, k = probs.numel(), min(64, probs.numel())
    while True:
        top = torch.topk(probs, k).values  # descending
        reached = torch.nonzero(torch.cumsum(top, dim=-1) >= top_p)
        if len(reached) or k == n:
            break
        k = min(n, k * 8)
    last = int(reached[0]) if len(reached) else k - 1  # the prefix 0..last reaches top_p (or all of it)
    return probs.masked_fill(probs < top[last], 0.0)


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse CDF: the first token whose cumulative probability exceeds u (u in [0, 1))."""
    cum = torch.cumsum(probs, dim=-1)
    idx = int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=cum.dtype), right=True))
    idx = min(idx, probs.numel() - 1)
    while probs[idx] == 0:  # never land on a token that was filtered out (rounding at the edges)
        idx -= 1
    return idx


def sample_token(logits: torch.Tensor, p: SamplingParams, u: float) -> int:
    """The sampled rule at one position: `sample_from(probabilities(logits, p), u)`. On CPU logits with the C++
    kernels loaded it runs as one fused call (`kernels.sample_row`: ~0.15 ms against ~1 ms of PyTorch ops on a 152k
    vocabulary, where ten candidates' steps spent ~12 ms of ~110 sampling); the two agree but for the rounding of
    their sums (a u within ~1e-7 of a boundary between two tokens). A process uses one of them for every request and
    tier."""
    x = logits.reshape(-1)
    if x.device.type == "cpu" and kernels.available():
        return kernels.sample_row(x.float().contiguous(), p.temperature, p.top_k, p.top_p, p.min_p, u)
    return sample_from(probabilities(x, p), u)


class Sampler:
    """Per-request sampling state: the params, the seeded stream of uniforms, the token history, the grammar's
    matcher (`constraint`, a grammar.Constraint, when the params carry a grammar) and, when asked, the record of
    emitted tokens' logprobs."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], constraint=None):
        if (params.grammar is None) != (constraint is None):
            raise SamplingError("a grammar needs its constraint (GrammarCompiler.constraint), and only a grammar")
        self.params, self.constraint = params, constraint
        self.gen = None if params.greedy else params.generator()
        self._ahead: list[float] = []  # uniforms drawn from the stream but not used yet (peeked by drafters)
        self.history = list(prompt_ids)
        self.n_prompt = len(prompt_ids)
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []

    def adjusted(self, logits: torch.Tensor, history: list[int] | None = None) -> torch.Tensor:
        """The logits after bias and penalties and the grammar's mask, given the tokens before the position
        (default: this request's history)."""
        history = self.history if history is None else history
        if self.constraint is not None:
            logits = self.constraint.apply(logits, history[self.n_prompt:])
        return adjust_logits(logits, history, self.n_prompt, self.params)

    def cut(self, tokens: list[int], parents: list[int] | None):
        """Drafts after the history without the ones the grammar refuses (all of them without a grammar):
        (tokens, parents), see grammar.Constraint.cut."""
        if self.constraint is None or not tokens:
            return tokens, parents
        return self.constraint.cut(self.history[self.n_prompt:], tokens, parents)

    def uniform(self, ahead: int = 0) -> float:
        """The uniform the sample `ahead` positions from now will use (0: the next one); not consumed."""
        while len(self._ahead) <= ahead:
            self._ahead.append(float(torch.rand(1, generator=self.gen, dtype=torch.float64)))
        return self._ahead[ahead]

    def draft(self, logits: torch.Tensor, history: list[int], ahead: int) -> int:
        """A drafter's token for the position `ahead` positions from now, from its own logits there and the
        tokens before it: what this sampler would emit there if the target's logits were these (greedy: the
        argmax after the penalty; sampled: the inverse CDF at the very uniform the target will use)."""
        if self.params.greedy:
            return int(torch.argmax(self.adjusted(logits, history)))
        return sample_token(self.adjusted(logits, history), self.params, self.uniform(ahead))

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] for the next position -> token id; records it in the history (and its logprobs)."""
        tok = self.draft(logits, self.history, 0)  # the one rule, here at the next position
        if not self.params.greedy:
            self._ahead.pop(0)  # its uniform is used now
        self.history.append(tok)
        if self.logprobs is not None:
            self.logprobs.append(self._logprob(logits, tok))
        return tok

    def _logprob(self, logits: torch.Tensor, tok: int) -> TokenLogprob:
        lp = torch.log_softmax(logits.float().reshape(-1), dim=-1)
        top = []
        if self.params.logprobs:
            vals, idx = torch.topk(lp, self.params.logprobs)
            top = [(int(i), float(v)) for i, v in zip(idx, vals)]
        return TokenLogprob(tok, float(lp[tok]), top)
