"""mesh.request.prompt: body validation, rendering, block keys, session key-chain cache, session ids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.cluster.registry import WorkerRegistry
from mesh.config import WorkerConfig, parse_config
from mesh.core.keys import block_keys, namespace_seed
from mesh.errors import MeshError
from mesh.request.prompt import OFFLOAD_CHARS, ChainCache, PromptProcessor, render_chatml
from mesh.request.tokenizer import ByteTokenizer

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"])},
    optional={"content": st.one_of(st.none(), text, st.lists(st.builds(lambda t: {"type": "text", "text": t}, text), max_size=3))},
)


@settings(max_examples=200, deadline=None)
@given(st.lists(message, min_size=1, max_size=5))
def test_fast_chatml_equals_the_template(messages: list[dict]) -> None:
    assert render_chatml(messages) == ByteTokenizer().render_chat(messages)


def processor(block_size: int = 4, **sections: object) -> PromptProcessor:
    reg = WorkerRegistry(parse_config(dict(sections)))
    reg.add(WorkerConfig(name="w", url="http://h:1", models=["m"], block_size=block_size))
    return PromptProcessor(reg)


def body(**fields: object) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


async def test_chat_keys_match_block_keys_of_the_rendered_prompt() -> None:
    p = processor()
    messages = [{"role": "user", "content": "hello there, router"}]
    parsed = await p.process(body(messages=messages, stream=True, max_tokens=5), "chat", None)
    rendered = ByteTokenizer().render_chat(messages)
    tokens = list(rendered.encode())
    assert parsed.stream and parsed.info.max_tokens == 5 and parsed.model == "m"
    assert parsed.info.prompt_tokens == len(tokens) and parsed.info.block_size == 4
    assert list(parsed.info.block_keys) == block_keys(tokens, 4, namespace_seed("m"))
    assert parsed.raw == body(messages=messages, stream=True, max_tokens=5)  # forwarded unchanged


async def test_completion_prompt_forms() -> None:
    p = processor()
    by_text = await p.process(body(prompt="abcdefgh"), "completion", None)
    by_list = await p.process(body(prompt=["abcdefgh", "zz"]), "completion", None)
    by_ids = await p.process(body(prompt=list(b"abcdefgh")), "completion", None)
    by_batch = await p.process(body(prompt=[list(b"abcdefgh"), [1]]), "completion", None)
    assert by_text.info.block_keys == by_list.info.block_keys == by_ids.info.block_keys == by_batch.info.block_keys
    assert len(by_text.info.block_keys) == 2


async def test_cache_salt_changes_the_namespace() -> None:
    p = processor()
    a = await p.process(body(prompt="abcdefgh"), "completion", None)
    b = await p.process(body(prompt="abcdefgh", cache_salt="tenant-2"), "completion", None)
    assert a.info.block_keys[0] != b.info.block_keys[0]


async def test_session_turns_reuse_the_chain_and_agree_with_a_fresh_hash() -> None:
    p = processor()
    turns = [[{"role": "user", "content": "first turn " * 5}]]
    turns.append(turns[0] + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "second " * 9}])
    results = [await p.process(body(messages=t, user="alice"), "chat", None) for t in turns]
    assert len(p.chains) == 1
    fresh = processor()
    for t, r in zip(turns, results, strict=True):
        assert list(r.info.block_keys) == list((await fresh.process(body(messages=t), "chat", None)).info.block_keys)
    first, second = (r.info.block_keys for r in results)
    assert list(second[: len(first) - 1]) == list(first[:-1])  # shared prefix blocks, same keys


async def test_long_prompts_are_hashed_off_loop_with_the_same_result() -> None:
    p = processor()
    long = "x" * (OFFLOAD_CHARS * 2)
    parsed = await p.process(body(prompt=long), "completion", None)
    assert list(parsed.info.block_keys) == block_keys(np.frombuffer(long.encode(), np.uint8), 4, namespace_seed("m"))


async def test_session_id_from_header_or_body_is_hashed() -> None:
    p = processor(sessions={"body_field": "user"})
    by_header = await p.process(body(prompt="a", user="ignored"), "completion", b"sess-1")
    assert by_header.info.session_id == xxhash.xxh3_128_hexdigest(b"sess-1")
    by_body = await p.process(body(prompt="a", user="sess-1"), "completion", None)
    assert by_body.info.session_id == by_header.info.session_id
    assert (await p.process(body(prompt="a"), "completion", None)).info.session_id is None
    long_id = await p.process(body(prompt="a"), "completion", b"s" * 100_000)  # kept as its hash only
    assert long_id.info.session_id == xxhash.xxh3_128_hexdigest(b"s" * 100_000)
    # an empty header falls back to the body field (it turned sessions off)
    assert (await p.process(body(prompt="a", user="sess-1"), "completion", b"")).info.session_id == by_body.info.session_id


def test_chain_cache_is_bounded_by_entries_and_tokens() -> None:
    from mesh.core.keys import KeyChain

    cache = ChainCache(max_entries=3, max_tokens=100)
    for i in range(5):
        chain = KeyChain(4, 1)
        chain.extend_to(list(range(30)))
        cache.checkin((f"s{i}", 1, 4), chain)
    assert len(cache) == 3 and cache.tokens == 90
    assert cache.checkout(("s0", 1, 4)) is None  # least recently used went first
    assert cache.checkout(("s4", 1, 4)) is not None and len(cache) == 2
    big = KeyChain(4, 1)
    big.extend_to(list(range(60)))
    cache.checkin(("big", 1, 4), big)
    assert cache.tokens <= 100


@pytest.mark.parametrize(
    ("raw", "kind", "status", "code"),
    [
        (b"", "chat", 400, "empty_body"),
        (b"{", "chat", 400, "invalid_json"),
        (b'{"model": "m", "prompt": "\xff"}', "completion", 400, "invalid_utf8"),
        (b'{"model": "m", "prompt": "\\ud800"}', "completion", 400, "invalid_json"),
        (b"[1, 2]", "chat", 400, "invalid_json"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "chat", 400, "missing_model"),
        (b'{"model": 5, "prompt": "x"}', "completion", 400, "missing_model"),
        (b'{"model": "m"}', "chat", 400, "missing_messages"),
        (b'{"model": "m", "messages": []}', "chat", 400, "missing_messages"),
        (b'{"model": "m", "messages": ["hi"]}', "chat", 400, "invalid_messages"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "chat", 400, "invalid_messages"),
        (b'{"model": "m"}', "completion", 400, "invalid_prompt"),
        (b'{"model": "m", "prompt": [-1]}', "completion", 400, "invalid_prompt"),
        (b'{"model": "m", "prompt": [4294967296]}', "completion", 400, "invalid_prompt"),
        (b'{"model": "m", "prompt": [true]}', "completion", 400, "invalid_prompt"),
        (b'{"model": "m", "prompt": "x", "max_tokens": 10000000000}', "completion", 400, "invalid_max_tokens"),
        (b'{"model": "m", "prompt": "x", "max_tokens": 0}', "completion", 400, "invalid_max_tokens"),
        (b'{"model": "m", "prompt": "x", "max_tokens": "5"}', "completion", 400, "invalid_request"),
        (b'{"model": "m", "prompt": "x", "stream": "yes"}', "completion", 400, "invalid_request"),
        (b'{"model": "other", "prompt": "x"}', "completion", 404, "model_not_found"),
    ],
)
async def test_bad_bodies_are_rejected_with_status_and_code(raw: bytes, kind: str, status: int, code: str) -> None:
    with pytest.raises(MeshError) as info:
        await processor().process(raw, kind, None)
    assert (info.value.status, info.value.code) == (status, code), info.value.message


async def test_no_workers_is_503() -> None:
    p = PromptProcessor(WorkerRegistry(parse_config({})))
    with pytest.raises(MeshError) as info:
        await p.process(body(prompt="x"), "completion", None)
    assert info.value.status == 503


async def test_a_lora_adapter_is_keyed_in_its_base_namespace_and_uses_the_base_pool() -> None:
    reg = WorkerRegistry(parse_config({}))
    reg.add(WorkerConfig(name="base-only", url="http://h:1", models=["m"], block_size=4))
    reg.add(WorkerConfig(name="multi", url="http://h:2", models=["m"], loras={"sql": "m"}, block_size=8))
    p = PromptProcessor(reg)
    prompt = list(range(1, 17))
    for salt in (None, "tenant-a"):
        extra = {"cache_salt": salt} if salt else {}
        lora = await p.process(body(model="sql", prompt=prompt, **extra), "completion", None)
        base = await p.process(body(prompt=prompt, **extra), "completion", None)
        assert lora.model == lora.info.model == "sql" and lora.info.lora == "sql" and base.info.lora is None
        assert lora.info.block_size == base.info.block_size == 4  # the base model's pool: its first worker's
        assert list(lora.info.block_keys) == block_keys(prompt, 4, namespace_seed("m", "sql", salt))
        assert list(base.info.block_keys) == block_keys(prompt, 4, namespace_seed("m", None, salt))
        assert lora.info.block_keys[0] != base.info.block_keys[0]
    # the seed cache is keyed by (base, adapter, salt) and stays bounded
    for i in range(10_050):
        p._seed("m", f"salt-{i}", "sql")
    assert len(p._seeds) <= 10_001
    assert p._seed("m", "x", "sql") == namespace_seed("m", "sql", "x") != p._seed("m", "x")


async def test_an_adapter_discovered_later_moves_its_requests_to_the_lora_namespace() -> None:
    reg = WorkerRegistry(parse_config({}))
    w = reg.add(WorkerConfig(name="w", url="http://h:1", block_size=4))  # models: discovered
    w.discovered_models = frozenset({"m", "sql"})  # /v1/models before the parent was known
    reg.version += 1
    p = PromptProcessor(reg)
    before = await p.process(body(model="sql", prompt=list(range(8))), "completion", None)
    assert before.info.lora is None and list(before.info.block_keys) == block_keys(range(8), 4, namespace_seed("sql"))
    w.discovered_models, w.discovered_loras = frozenset({"m"}), {"sql": "m"}  # what a discovery round sets
    reg.version += 1
    w.sync()
    after = await p.process(body(model="sql", prompt=list(range(8))), "completion", None)
    assert after.info.lora == "sql" and list(after.info.block_keys) == block_keys(range(8), 4, namespace_seed("m", "sql"))
    assert reg.targets["w"].models == {"m", "sql"} and reg.targets["w"].loras == {"sql"}
    with pytest.raises(MeshError) as info:
        await p.process(body(model="chat", prompt="x"), "completion", None)
    assert info.value.status == 404


async def test_the_pools_default_chat_template_kwargs_reach_the_template_under_the_request(tmp_path: Path) -> None:
    """vLLM's --default-chat-template-kwargs, set per worker: a request's kwargs override them."""
    from tests.support.chat_templates import build_tokenizer

    template = "{{ messages[0]['content'] }}|thinking={{ enable_thinking }}|style={{ style }}"
    tok = build_tokenizer(tmp_path / "tok", template)
    reg = WorkerRegistry(parse_config({}))
    reg.add(WorkerConfig(name="w", url="http://h:1", models=["m"], tokenizer=str(tok),
                         default_chat_template_kwargs={"enable_thinking": False, "style": "terse"}))
    p = PromptProcessor(reg)
    msgs = [{"role": "user", "content": "hi"}]
    plain = await p.process(body(messages=msgs), "chat", None)
    assert plain.info.text == "hi|thinking=False|style=terse"
    over = await p.process(body(messages=msgs, chat_template_kwargs={"enable_thinking": True, "style": None}), "chat", None)
    assert over.info.text == "hi|thinking=True|style=terse"
