"""A stand-in prompt text for simulated requests, for text-based policies (``cache_aware``).

Traces carry block ids, not text, but SGLang's approximate router (``policies/cache_aware.py``)
matches the request *text* in its radix tree. Without a text every simulated request had an
empty one, so ``cache_aware`` never matched anything and always routed to the least loaded
target: ``mesh simulate`` reported least-load numbers under cache_aware's name.

``BlockText`` spells a request's chained block keys as characters, one code per key: two requests
share a text prefix exactly as far as they share leading blocks (a chained key names its whole
prefix, so equal keys at a position mean equal prompts up to there). Codes are interned in order
of first sight, prefix-free and valid Unicode (the surrogates U+D800..U+DFFF are skipped: a lone
one cannot be encoded, and a policy may hash the text): the first 2**20 - 2048 keys are one
character below U+100000; later keys are two characters, the first in U+100000..U+10FFFF (never
a one-character code). Match rates are
therefore in blocks, which is the token fraction over full blocks; ``max_tree_chars`` counts
blocks in a simulation.
"""

from __future__ import annotations

from collections.abc import Sequence

_ONE = 0x100000  # one-character codes: below this code point
_SURROGATES = 0x800  # U+D800..U+DFFF: never a code
_N_ONE = _ONE - _SURROGATES  # how many one-character codes there are


def _char(i: int) -> str:
    """The ``i``-th non-surrogate code point (``i < 0x10F800``)."""
    return chr(i if i < 0xD800 else i + _SURROGATES)


class BlockText:
    """Interns block keys into prefix-free character codes; ``text(keys)`` spells a prompt."""

    __slots__ = ("_codes",)

    def __init__(self) -> None:
        self._codes: dict[int, str] = {}

    def text(self, keys: Sequence[int]) -> str:
        codes = self._codes
        get = codes.get
        parts = [get(k) or self._intern(k) for k in keys]
        return "".join(parts)

    def _intern(self, key: int) -> str:
        n = len(self._codes)
        if n < _N_ONE:
            code = _char(n)
        else:
            high, low = divmod(n - _N_ONE, _N_ONE)
            if _ONE + high > 0x10FFFF:
                raise OverflowError("more than 68 billion distinct block keys")
            code = chr(_ONE + high) + _char(low)
        self._codes[key] = code
        return code
