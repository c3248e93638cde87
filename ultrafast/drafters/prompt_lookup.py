"""Prompt lookup decoding: match the last few tokens against the prompt and the text generated so far,
and propose what followed their most recent earlier occurrence."""

from __future__ import annotations

from .ngram_index import NgramIndex


class PromptLookupDrafter:
    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        self.levels = tuple(range(min_ngram, max_ngram + 1))
        self.index = NgramIndex(self.levels)
        self.match_len = 0  # of the last proposal

    def begin(self, prompt_ids: list[int]) -> None:
        self.index = NgramIndex(self.levels)
        self.index.extend(prompt_ids)

    def propose(self, context: list[int], k: int, sampler=None) -> list[int]:
        self.index.extend(context[len(self.index.tokens):])
        self.match_len, drafts = self.index.lookup(context, k)
        return drafts

    def end(self, context: list[int]) -> None:
        pass
