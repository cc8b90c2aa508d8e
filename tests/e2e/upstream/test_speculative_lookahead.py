"""Speculative decoding workers: vLLM's lookahead block hashes and SGLang's bigram pages (EAGLE),
from the pinned wheels' own caches, against the overlap Mesh predicts for a prompt.

Under EAGLE a block's identity covers the token(s) after it: vLLM hashes each block with its
``num_hash_lookahead_tokens`` following tokens, SGLang keys its radix tree by bigrams. Two prompts
that share N blocks and part at the first token after them share only N - 1 reusable blocks, and
the two variants of block N are two engine blocks. For every probe, the overlap Mesh's router
computes for the prompt (``ClusterView.overlaps`` on the request as ``mesh.request`` keys it:
its plain keys, its tokens and key seed) must equal the tokens the engine's own cache would hit.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from mesh.core.keys import block_keys, namespace_seed
from mesh.core.lookahead import prompt_keys
from policies.base import ClusterView, RequestInfo
from tests.support.upstream_driver import Driver, Stack
from tests.support.upstream_driver import stack as upstream_stack

BS = 4
MODEL = "upstream-eagle"


def predicted(s: Stack, tokens: list[int]) -> int:
    """The tokens Mesh's router counts as cached on the engine for this prompt."""
    seed = namespace_seed(MODEL)
    info = RequestInfo(model=MODEL, block_keys=block_keys(tokens, BS, seed), block_size=BS,
                       prompt_tokens=len(tokens), tokens=tokens, key_seed=seed)
    got = ClusterView(targets=[], now=0.0, index=s.index).overlaps(info).get(s.targets[0])
    return got.gpu_blocks * BS if got else 0


def hit(s: Stack, tokens: list[int]) -> int:
    reply: dict[str, Any] = s.driver.send("peek", tokens=tokens)
    return int(reply["hit_tokens"])


def vllm_keys(s: Stack, lookahead: int) -> set[int]:
    """The lookahead keys of the blocks vLLM holds (each held block's prefix and the tokens after it)."""
    return {prompt_keys(b["tokens"], BS, namespace_seed(MODEL), lookahead)[-1] for b in s.truth()}


SHARED = list(range(500, 500 + 3 * BS))  # three full blocks
A = SHARED + list(range(10, 10 + 2 * BS + 1))  # parts from B at the first token after block 3
B = SHARED + list(range(40, 40 + 2 * BS + 1))


@pytest.mark.parametrize("lookahead", [1, 2])
async def test_vllm_lookahead_hashes_credit_a_block_only_when_the_tokens_after_it_match(
        vllm_driver: Driver, lookahead: int) -> None:
    cfg = {"block_size": BS, "num_blocks": 16, "lookahead": lookahead}
    async with upstream_stack(vllm_driver, cfg, block_size=BS, model=MODEL) as s:
        await s.serve(A)
        assert s.index.lookaheads == {s.targets[0]: lookahead}  # detected from lookahead_token_ids
        assert hit(s, B) == 2 * BS  # block 3's hash covers the token after it, where B parts from A
        assert predicted(s, B) == hit(s, B)
        assert predicted(s, A) == hit(s, A) > 3 * BS
        await s.serve(B)  # block 3 in two variants now: two engine blocks
        assert s.index.keys_of(s.targets[0]) == vllm_keys(s, lookahead)
        assert predicted(s, B) == hit(s, B) > 3 * BS
        for i in range(12):  # unrelated prompts evict A's variant of block 3 before B's
            await s.serve(list(range(1000 * (i + 1), 1000 * (i + 1) + 2 * BS + lookahead)))
            assert s.index.keys_of(s.targets[0]) == vllm_keys(s, lookahead)
            held = [b["tokens"][: 3 * BS + 1] for b in s.truth() if len(b["tokens"]) > 3 * BS]
            if A[: 3 * BS + 1] not in held:
                break
        assert A[: 3 * BS + 1] not in held and B[: 3 * BS + 1] in held
        assert predicted(s, A) == hit(s, A) == 2 * BS
        assert predicted(s, B) == hit(s, B) > 3 * BS


async def test_vllm_lookahead_prompts_of_every_length_predict_the_engines_hit(vllm_driver: Driver) -> None:
    """Sessions over a shared prefix, cut at every length around block boundaries: each probe's
    predicted overlap equals vLLM's hit, through allocations and LRU evictions."""
    rng = random.Random(3)
    cfg = {"block_size": BS, "num_blocks": 20, "lookahead": 1}
    async with upstream_stack(vllm_driver, cfg, block_size=BS, model=MODEL) as s:
        base = [rng.randrange(50) for _ in range(2 * BS)]
        prompts = [base + [rng.randrange(3) for _ in range(rng.randrange(1, 4 * BS))] for _ in range(14)]
        probes = 0
        for tokens in prompts:
            await s.serve(tokens)
            for other in prompts:
                for cut in range(BS, len(other) + 1, max(1, BS - 1)):
                    assert predicted(s, other[:cut]) == hit(s, other[:cut]), other[:cut]
                    probes += 1
        assert probes > 200


async def test_vllm_declared_lookahead_agrees_and_a_wrong_declaration_is_counted(vllm_driver: Driver) -> None:
    cfg = {"block_size": BS, "num_blocks": 16, "lookahead": 1}
    async with upstream_stack(vllm_driver, cfg, block_size=BS, model=MODEL, lookahead_tokens=2) as s:
        await s.serve(A)
        assert s.sub.health()[s.targets[0]].events.get("lookahead_mismatch") == 1
        assert s.index.lookaheads == {s.targets[0]: 1}  # keyed as the events show
        assert predicted(s, B) == hit(s, B) == 2 * BS


async def test_sglang_bigram_pages_credit_a_page_only_when_the_token_after_it_matches(
        sglang_driver: Driver) -> None:
    cfg = {"page_size": BS, "capacity": 10 * BS, "eagle": True}
    async with upstream_stack(sglang_driver, cfg, block_size=BS, model=MODEL) as s:
        await s.serve(A)
        assert s.index.lookaheads == {s.targets[0]: 1}  # detected from the bigram pages
        assert hit(s, B) == 2 * BS
        assert predicted(s, B) == hit(s, B)
        assert predicted(s, A) == hit(s, A) > 3 * BS
        await s.serve(B)
        assert predicted(s, A) == hit(s, A) and predicted(s, B) == hit(s, B) > 3 * BS
        rng = random.Random(8)
        for i in range(10):  # LRU evictions past the capacity
            tokens = SHARED[: rng.randrange(2 * BS)] + [rng.randrange(9) for _ in range(rng.randrange(1, 3 * BS))]
            await s.serve(tokens)
            for probe in (A, B, tokens, A[: 3 * BS + 1], B[: 3 * BS + 2]):
                assert predicted(s, probe) == hit(s, probe), (i, probe)
