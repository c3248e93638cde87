import pytest

from ultrafast.drafters.prompt_lookup import PromptLookupDrafter

# a "file" in the prompt that the output re-sends with an insertion; token 6 occurs in it twice
PROMPT = [90, 91, 1, 2, 92, 93, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 94, 6, 95]
SOURCE = PROMPT.index(3)


def test_the_copy_resumes_where_it_left_the_source():
    d = PromptLookupDrafter()
    d.begin(PROMPT)
    out = PROMPT + [1, 2]
    assert d.propose(out, 3) == [3, 4, 5] and d.match_len == 2
    out += [3, 4, 5, 50, 51]  # the output follows the copy for three tokens, then inserts 50 51
    d.propose(out, 3)
    assert d.anchor == SOURCE + 3  # the place in the source where the output left it
    out += [52, 6]  # the insertion ends and the copy goes on with 6: its most recent occurrence is followed by
    # 95, the one right after the anchor by the copy's continuation, which is proposed and marked near
    assert d.propose(out, 3) == [7, 8, 9] and d.near and d.match_len == 1
    far = PromptLookupDrafter(window=0)  # no anchor: the most recent occurrence
    far.begin(PROMPT)
    assert far.propose(out, 3) == [95, 1, 2] and not far.near
    out += [7, 8, 9]
    assert d.propose(out, 2) == [10, 11] and d.near and d.match_len == 4


def test_without_a_copy_the_most_recent_match_is_taken():
    d = PromptLookupDrafter(window=0)
    d.begin(PROMPT)
    assert d.propose(PROMPT + [1, 2], 2) == [3, 4] and not d.near
    d2 = PromptLookupDrafter()
    d2.begin([1, 7, 1, 8])
    assert d2.propose([1, 7, 1, 8, 1], 1) == [8] and not d2.near  # no anchor yet
    with pytest.raises(ValueError):
        PromptLookupDrafter(window=-1)
