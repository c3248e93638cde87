"""A draft model that shares the target's tokenizer (e.g. Qwen2.5-Coder-0.5B for the 1.5B): it keeps its own
KV cache in step with the accepted tokens and drafts greedily, one cheap forward per drafted token."""

from __future__ import annotations


class DraftModelDrafter:
    name = "draft_model"

    def __init__(self, engine, cost_per_token: float = 0.5):
        self.engine = engine
        self.cost_per_token = cost_per_token  # one draft forward, in target 1-token forwards
        self.fed: list[int] = []  # tokens whose KV the draft model's cache holds, in order

    def begin(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) + 64 > self.engine.max_context:
            raise ValueError("prompt too long for the draft model's context")
        self.fed = []

    def propose(self, context: list[int], k: int) -> list[int]:
        if k <= 0 or len(context) + k >= self.engine.max_context:
            return []
        common = 0  # the cache is valid up to the first token where what was fed and the context differ
        for a, b in zip(self.fed, context):
            if a != b:
                break
            common += 1
        common = min(common, len(context) - 1)  # always feed at least the last token to get its logits
        logits = self.engine._forward(context[common:], common)[-1]
        self.fed = list(context)
        drafts = []
        while True:
            tok = int(logits.argmax())
            drafts.append(tok)
            if len(drafts) == k:
                return drafts
            logits = self.engine._forward([tok], len(self.fed))[-1]
            self.fed.append(tok)

    def end(self, context: list[int]) -> None:
        self.fed = []
