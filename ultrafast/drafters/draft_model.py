"""A draft model that shares the target's tokenizer (e.g. Qwen2.5-Coder-0.5B for the 1.5B): it keeps its own
KV cache in step with the accepted tokens and drafts one cheap forward per drafted token. Each draft is what
the request's sampler picks from the draft model's logits at that position (`Sampler.draft`): the argmax for
a greedy request, for a sampled one the inverse CDF at the uniform the target will use there."""

from __future__ import annotations


class DraftModelDrafter:
    name = "draft_model"

    def __init__(self, engine, cost_per_token: float = 0.5, feed_cost: float = 0.0):
        self.engine = engine
        self.cost_per_token = cost_per_token  # one draft forward, in target 1-token forwards
        self.feed_cost = feed_cost  # one token fed in a batch (catching up), in target 1-token forwards
        self.fed: list[int] = []  # tokens whose KV the draft model's cache holds, in order

    def begin(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) + 64 > self.engine.max_context:
            raise ValueError("prompt too long for the draft model's context")
        self.fed = []

    def _common(self, context: list[int]) -> int:
        """How many leading context tokens the cache holds; at most all but the last (fed to get its logits)."""
        common = 0  # the cache is valid up to the first token where what was fed and the context differ
        for a, b in zip(self.fed, context):
            if a != b:
                break
            common += 1
        return min(common, len(context) - 1)

    def catch_up_cost(self, context: list[int]) -> float:
        """What feeding the tokens the cache lacks costs before the first draft, in target 1-token forwards."""
        return self.feed_cost * (len(context) - 1 - self._common(context))

    def _run(self, context: list[int], k: int, pick) -> list[int]:
        """Feed what the cache lacks, then draft k tokens, each chosen by pick(logits, tokens before it)."""
        if k <= 0 or len(context) + k >= self.engine.max_context:
            return []
        common = self._common(context)
        logits = self.engine.forward(context[common:], common)[-1]
        self.fed = list(context)
        drafts = []
        while True:
            tok = pick(logits, self.fed)
            drafts.append(tok)
            if len(drafts) == k:
                return drafts
            logits = self.engine.forward([tok], len(self.fed))[-1]
            self.fed.append(tok)

    def propose(self, context: list[int], k: int, sampler=None) -> list[int]:
        """Up to k drafts, each the sampler's choice from the draft's logits (None: the argmax)."""
        n = len(context)
        if sampler is None:
            return self._run(context, k, lambda logits, _history: int(logits.argmax()))
        return self._run(context, k, lambda logits, history: sampler.draft(logits, history, len(history) - n))

    def end(self, context: list[int]) -> None:
        self.fed = []
