import pytest

from ultrafast.drafters.ngram_index import NgramIndex


def test_lookup_takes_the_longest_match_at_its_most_recent_occurrence():
    idx = NgramIndex((1, 2, 3))
    idx.extend([1, 2, 3, 9, 1, 2, 4, 5])
    assert idx.lookup([7, 1, 2], 3) == (2, [4, 5])  # "1 2" last seen before 4
    assert idx.lookup_at([2, 3], 2) == (2, 3, [9, 1])
    assert idx.lookup([8], 2) == (0, [])


def test_lookup_near_prefers_the_occurrence_at_or_after_the_anchor():
    toks = [5, 1, 6, 7, 1, 8, 9, 1, 3]  # token 1 ends at positions 2, 5 and 8
    idx = NgramIndex((1, 2), every_occurrence=True)
    idx.extend(toks)
    assert idx.lookup_at([1], 2) == (1, 8, [3])  # the most recent
    assert idx.lookup_near([1], 2, anchor=3, window=8) == (1, 5, [8, 9])  # the first at or after the anchor
    assert idx.lookup_near([1], 2, anchor=0, window=8) == (1, 2, [6, 7])
    assert idx.lookup_near([1], 2, anchor=6, window=1) == (0, -1, [])  # 8 is beyond the window
    assert idx.lookup_near([7, 1], 2, anchor=0, window=8) == (2, 5, [8, 9])  # the longer n-gram first
    idx.extend([1, 4])  # new tokens are indexed as they come
    assert idx.lookup_near([1], 1, anchor=9, window=1) == (1, 10, [4])


def test_lookup_near_needs_every_occurrence():
    idx = NgramIndex((1,))
    with pytest.raises(ValueError, match="every_occurrence"):
        idx.lookup_near([1], 1, anchor=0, window=4)
