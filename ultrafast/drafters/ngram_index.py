"""An index from n-grams of a token sequence to where they occurred: the lookup behind the prompt-lookup and
suffix drafters. Appending is O(levels) per token; a lookup is O(levels) (O(levels log occurrences) near an
anchor)."""

from __future__ import annotations

from bisect import bisect_left


class NgramIndex:
    def __init__(self, levels: tuple[int, ...], *, every_occurrence: bool = False):
        self.levels = tuple(sorted(set(levels), reverse=True))  # longest first
        self.tokens: list[int] = []
        # per level, n-gram -> the end of its most recent occurrence (_maps); or, with every_occurrence (which
        # `lookup_near` needs), n-gram -> every occurrence's end, ascending, the last the most recent (_all).
        # One of the two is kept, the other is None.
        self._maps: dict[int, dict[tuple, int]] | None = None if every_occurrence else {n: {} for n in self.levels}
        self._all: dict[int, dict[tuple, list[int]]] | None = {n: {} for n in self.levels} if every_occurrence \
            else None
        self._indexed = 0  # n-grams ending before this position are in the maps

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def _catch_up(self) -> None:
        # index n-grams whose continuation exists: those ending at e <= len-1 map to e
        toks = self.tokens
        for e in range(self._indexed + 1, len(toks)):
            for n in self.levels:
                if e >= n:
                    if self._all is None:
                        self._maps[n][tuple(toks[e - n:e])] = e
                    else:
                        self._all[n].setdefault(tuple(toks[e - n:e]), []).append(e)
        self._indexed = max(self._indexed, len(toks) - 1)

    def lookup_at(self, suffix: list[int], k: int, min_n: int = 1) -> tuple[int, int, list[int]]:
        """The longest indexed n-gram equal to the end of `suffix` (n >= min_n): (n, the position after its most
        recent occurrence, up to k tokens from there). (0, -1, []) when nothing matches."""
        self._catch_up()
        for n in self.levels:
            if n < min_n or n > len(suffix):
                continue
            key = tuple(suffix[-n:])
            if self._all is None:
                e = self._maps[n].get(key)
            else:
                ends = self._all[n].get(key)
                e = ends[-1] if ends else None
            if e is not None:
                return n, e, self.tokens[e:e + k]
        return 0, -1, []

    def lookup(self, suffix: list[int], k: int, min_n: int = 1) -> tuple[int, list[int]]:
        """`lookup_at` without the position: (n, up to k tokens after the n-gram's most recent occurrence)."""
        n, _, drafts = self.lookup_at(suffix, k, min_n)
        return n, drafts

    def lookup_near(self, suffix: list[int], k: int, anchor: int, window: int,
                    min_n: int = 1) -> tuple[int, int, list[int]]:
        """The longest n-gram equal to the end of `suffix` (n >= min_n) that occurs ending in [anchor, anchor +
        window]: (n, the first such end, up to k tokens from there); (0, -1, []) when none does. Needs
        every_occurrence."""
        if self._all is None:
            raise ValueError("lookup_near needs an index built with every_occurrence=True")
        self._catch_up()
        for n in self.levels:
            if n < min_n or n > len(suffix):
                continue
            ends = self._all[n].get(tuple(suffix[-n:]))
            if not ends:
                continue
            i = bisect_left(ends, anchor)
            if i < len(ends) and ends[i] <= anchor + window:
                return n, ends[i], self.tokens[ends[i]:ends[i] + k]
        return 0, -1, []
