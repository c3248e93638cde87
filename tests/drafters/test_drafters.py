"""Drafters by name: the `--drafters` option."""

import pytest

from ultrafast.drafters import KNOWN, parse_drafters


def test_parse_drafters():
    assert parse_drafters(None) is None and parse_drafters("") is None
    assert parse_drafters(" suffix, prompt_lookup ,") == ["suffix", "prompt_lookup"]
    assert parse_drafters(",".join(KNOWN)) == list(KNOWN)
    with pytest.raises(ValueError, match=r"unknown drafter\(s\) \['nope'\]; known: prompt_lookup"):
        parse_drafters("suffix,nope")
