"""An index from n-grams of a token sequence to where they last occurred: the lookup behind the
prompt-lookup and suffix drafters. Appending is O(levels) per token; a lookup is O(levels)."""

from __future__ import annotations


class NgramIndex:
    def __init__(self, levels: tuple[int, ...]):
        self.levels = tuple(sorted(set(levels), reverse=True))  # longest first
        self.tokens: list[int] = []
        self._maps: dict[int, dict[tuple, int]] = {n: {} for n in self.levels}
        self._indexed = 0  # n-grams ending before this position are in the maps

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def _catch_up(self) -> None:
        # index n-grams whose continuation exists: those ending at e <= len-1 map to e
        toks = self.tokens
        for e in range(self._indexed + 1, len(toks)):
            for n in self.levels:
                if e >= n:
                    self._maps[n][tuple(toks[e - n:e])] = e
        self._indexed = max(self._indexed, len(toks) - 1)

    def lookup(self, suffix: list[int], k: int, min_n: int = 1) -> tuple[int, list[int]]:
        """The longest indexed n-gram equal to the end of `suffix` (n >= min_n): (n, up to k tokens after its
        most recent occurrence). (0, []) when nothing matches."""
        self._catch_up()
        for n in self.levels:
            if n < min_n or n > len(suffix):
                continue
            e = self._maps[n].get(tuple(suffix[-n:]))
            if e is not None:
                return n, self.tokens[e:e + k]
        return 0, []
