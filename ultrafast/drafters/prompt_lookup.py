"""Prompt lookup decoding: match the last few tokens against the prompt and the text generated so far,
and propose what followed an earlier occurrence.

Which occurrence: the text being copied, where there is one. The drafter follows its copy: after each
proposal it checks how far the emitted tokens went on matching the text it copied from, and keeps that place
(the anchor) even where the output broke off, to write something new (a docstring inserted into a file being
re-sent, a signature rewritten). Matches that end at or shortly after the anchor are preferred to the most
recent occurrence elsewhere, so that after an edit the copy picks up where it left the source, from a match of
one or two tokens that would be ambiguous anywhere else. Such a proposal is reported as `near`: the policy
keeps its acceptance apart from the far matches'.
"""

from __future__ import annotations

from .ngram_index import NgramIndex


class PromptLookupDrafter:
    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, window: int = 48):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        if window < 0:
            raise ValueError("prompt lookup's window must be >= 0")
        self.levels = tuple(range(min_ngram, max_ngram + 1))
        self.window = window
        self._start([])

    def begin(self, prompt_ids: list[int]) -> None:
        self._start(prompt_ids)

    def _start(self, prompt_ids: list[int]) -> None:
        self.index = NgramIndex(self.levels, every_occurrence=True)
        self.index.extend(prompt_ids)
        self.match_len = 0  # of the last proposal
        self.near = False  # whether it continued the copy (a match at the anchor) rather than a match elsewhere
        self._source: tuple[int, int] | None = None  # (where the last proposal copied from, the context's length)
        self.anchor: int | None = None  # the copy's place in the indexed tokens

    def _follow(self, context: list[int]) -> None:
        """Move the anchor over what was emitted since the last proposal, as far as it matched the source."""
        if self._source is None:
            return
        start, n = self._source
        emitted, src = context[n:], self.index.tokens
        m = 0
        while m < len(emitted) and start + m < n and src[start + m] == emitted[m]:
            m += 1
        self.anchor, self._source = start + m, None

    def propose(self, context: list[int], k: int, sampler=None) -> list[int]:
        self.index.extend(context[len(self.index.tokens):])
        self._follow(context)
        n = 0
        if self.anchor is not None and self.window:
            n, start, drafts = self.index.lookup_near(context, k, self.anchor, self.window)
        self.near = bool(n)
        if not n:
            n, start, drafts = self.index.lookup_at(context, k)
        self.match_len = n
        if n:
            self._source = (start, len(context))
        return drafts

    def end(self, context: list[int]) -> None:
        pass
