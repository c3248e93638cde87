"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): match the longest suffix of the context against this
request and against earlier requests' prompts and outputs kept by the process, and speculate a run whose
length grows with the match length, so that agent loops that repeat themselves draft long runs.

The matching structure here is an index of n-grams of several lengths up to 32 tokens (longest match
first, most recent occurrence), a bounded stand-in for the paper's suffix trees.
"""

from __future__ import annotations

from .ngram_index import NgramIndex

LEVELS = (32, 24, 16, 12, 8, 6, 4, 3, 2)
SEPARATOR = -1  # between requests in the shared history: never matches a real token


class SuffixCache:
    """The process-wide history of earlier requests (prompt + output), bounded to `max_tokens`."""

    def __init__(self, max_tokens: int = 200_000):
        self.max_tokens = max_tokens
        self.index = NgramIndex(LEVELS)

    def add(self, tokens: list[int]) -> None:
        if len(self.index.tokens) + len(tokens) > self.max_tokens:  # start over rather than grow without bound
            self.index = NgramIndex(LEVELS)
        self.index.extend(list(tokens) + [SEPARATOR])


class SuffixDrafter:
    name = "suffix"

    def __init__(self, cache: SuffixCache, *, tokens_per_matched: float = 2.0, min_match: int = 2):
        self.cache, self.tokens_per_matched, self.min_match = cache, tokens_per_matched, min_match
        self.local = NgramIndex(LEVELS)
        self.match_len = 0  # of the last proposal

    def begin(self, prompt_ids: list[int]) -> None:
        self.local = NgramIndex(LEVELS)
        self.local.extend(prompt_ids)

    def propose(self, context: list[int], k: int, sampler=None) -> list[int]:
        self.local.extend(context[len(self.local.tokens):])
        best_n, best = self.local.lookup(context, k, self.min_match)
        n, other = self.cache.index.lookup(context, k, max(self.min_match, best_n + 1))
        if n > best_n:
            best_n, best = n, other
        if SEPARATOR in best:
            best = best[:best.index(SEPARATOR)]
        self.match_len = best_n
        return best[: max(1, int(self.tokens_per_matched * best_n))] if best_n else []

    def end(self, context: list[int]) -> None:
        self.cache.add(context)
