"""Grammar drafts: the text the request's grammar forces next (the keys and punctuation of a JSON schema, the
rest of an enum value), in the tokenizer's tokens (`grammar.Constraint.forced`): right unless the model splits
the text otherwise. Free to propose; nothing without a grammar."""

from __future__ import annotations

GRAMMAR_MATCH = 64  # reported as the match length: its own class, which forced drafts keep near 100%


class GrammarDrafter:
    name = "grammar"

    def __init__(self):
        self.match_len = 0

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, context: list[int], k: int, sampler=None) -> list[int]:
        constraint = getattr(sampler, "constraint", None)
        if constraint is None or k < 1:
            return []
        drafts = constraint.forced(context[sampler.n_prompt:], k)
        self.match_len = GRAMMAR_MATCH if drafts else 0
        return drafts

    def end(self, context: list[int]) -> None:
        pass
