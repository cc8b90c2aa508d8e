"""``simulator.block_text.BlockText`` spells block keys as characters for text-based
policies in ``mesh simulate``. Codes are code points in order of first sight that skip the
surrogate range (U+D800..U+DFFF), so the 55,297th distinct key and every later one are
encodable: a policy that hashes or encodes the request's ``text`` (a plugin's consistent hash,
any UTF-8 use) never meets a lone surrogate mid-simulation."""

from __future__ import annotations

from simulator.block_text import BlockText


def test_every_spelling_is_valid_unicode_and_codes_stay_distinct_and_prefix_free() -> None:
    bt = BlockText()
    n = 0xD800 + 0x1000  # through the surrogate range of one-character codes
    text = bt.text(range(n))
    assert text.encode("utf-8").decode("utf-8") == text
    codes = [bt.text([k]) for k in range(n)]
    assert len(set(codes)) == n and all(len(c) == 1 for c in codes)


def test_two_character_codes_are_valid_unicode_too() -> None:
    bt = BlockText()
    bt.text(range(0x100000))  # every one-character code used: later keys get two characters
    later = [bt.text([k]) for k in range(10**7, 10**7 + 0xE000)]  # second characters through U+D800..U+DFFF
    assert all(len(c) == 2 and ord(c[0]) >= 0x100000 for c in later)
    assert "".join(later).encode("utf-8")
    assert len(set(later)) == len(later)
