"""The prompt path (chat rendering, tokenization, session key chains) against real processes.

A gateway that renders or tokenizes a request differently from the worker computes block keys the
worker never announces, and the prefix index never matches. Checked here: the gateway against the
bundled worker's own ``/tokenize`` and ``cached_tokens`` for every OpenAI message shape; the chat
template environment against Hugging Face's ``apply_chat_template`` (what vLLM and SGLang render
with); session key chains against from-scratch tokenization with a real BPE ``tokenizer.json``;
a template that raises on client data; a huge prompt with a ``tokenizer.json`` while the event loop
must keep answering.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.cluster.registry import WorkerRegistry
from mesh.config import WorkerConfig, parse_config
from mesh.core.keys import block_keys, namespace_seed
from mesh.errors import MeshError
from mesh.request.chat import ChatOptions, ChatRenderer, normalize_message
from mesh.request.prompt import TOKENIZER_RETRY_S, PromptProcessor
from mesh.request.tokenizer import GIL_FREE_CHARS, HFTokenizer, load_tokenizer
from tests.e2e_bundled import start_workers
from tests.procs import ProcessGroup, free_port, wait_until
from tests.support.chat_templates import CHATML, build_tokenizer

# a Llama-3.1-like line: string concatenation with a client field ("tool_call_id": null is a TypeError)
CONCAT = ("{% for m in messages %}{{ '<' + m.role + (('|' + m.tool_call_id) if 'tool_call_id' in m else '') + '>'"
          " + m.content }}{% endfor %}")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


# -- the template environment is Hugging Face's (what vLLM/SGLang render with) --
def test_tool_calls_render_as_hugging_face_renders_them(tok_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    templates = [
        CHATML,
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.content }}|{% endfor %}",
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
        "{{ messages[1].tool_calls | tojson(indent=2) }}",
    ]
    messages = [
        {"role": "user", "content": "héllo <b> & 'quoted'"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"zeta": "é<>&'", "alpha": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    for template in templates:
        hf.chat_template = template
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ChatRenderer(template).render(messages) == expected, template


def test_text_parts_are_joined_with_a_newline_as_vllm_joins_them() -> None:
    # vLLM (chat_utils, string content format): text_prompt = "\n".join(texts)
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert normalize_message({"role": "user", "content": parts})["content"] == "first\nsecond"


def test_a_chat_template_jinja_file_is_the_template_as_transformers_loads_it(tmp_path: Path) -> None:
    """Model directories saved by recent transformers carry the template in chat_template.jinja
    (it wins over tokenizer_config.json's entry): the gateway's ids equal apply_chat_template's."""
    from transformers import AutoTokenizer

    directory = build_tokenizer(tmp_path / "model", "{{ 'stale config template' }}")
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
    messages = [{"role": "system", "content": "the quick brown fox"}, {"role": "user", "content": "hello world"}]
    expected = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    ours = HFTokenizer(directory)
    assert ours.encode(ours.render_chat(messages)) == list(expected)


def test_special_tokens_reach_the_template_as_transformers_passes_them(tmp_path: Path) -> None:
    """A null bos_token (Qwen's configs) renders as transformers renders it, not as "None"; pad and
    unk reach the template too."""
    from transformers import AutoTokenizer

    directory = build_tokenizer(tmp_path / "model")
    template = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    config = {"chat_template": template, "bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "hello"}]
    expected = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(messages, tokenize=False)
    assert HFTokenizer(directory).render_chat(messages) == expected


def test_messages_reach_the_template_as_vllm_builds_them() -> None:
    """vLLM (chat_utils ``_parse_chat_message_content`` + ``_postprocess_messages``) hands the
    template a rebuilt message: tool-call ``arguments`` parsed from their JSON string, only the
    known fields. A Qwen2.5-style ``tool_call.arguments | tojson`` renders the parsed object, not the
    string quoted and escaped, so an agent turn after a tool call matches the engine's prompt."""
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% for tc in m.tool_calls or [] %}"
                "<{{ tc.function.name }} {{ tc.function.arguments | tojson }}>{% endfor %}"
                "{{ m | length }}{{ m.name is defined }}\n{% endfor %}")
    messages = [
        {"role": "user", "content": "hi", "name": None, "cache_control": {"type": "ephemeral"}},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "t", "arguments": ""}}]},
        {"role": "assistant", "content": "ok", "tool_calls": []},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "w"},
    ]
    before = json.dumps(messages)
    expected = ('user:hi2False\nassistant:<w {"city": "Paris"}><t {}>3False\nassistant:ok2False\n'
                "tool:sunny4True\n")
    assert ChatRenderer(template).render(messages, ChatOptions(add_generation_prompt=False)) == expected
    assert json.dumps(messages) == before  # the client's objects are not changed
    # A malformed call in the history (a model wrote broken JSON, or JSON that is no object) renders
    # with {} as vLLM does, so the conversation's later turns still go through.
    for broken in ("{oops", "[1, 2]", "42", 7, None):
        bad = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": broken}}]}]
        assert ChatRenderer(template).render(bad, ChatOptions(add_generation_prompt=False)) == "assistant:<w {}>3False\n"


# -- tokenization: the GIL-free path gives the same ids; session chains equal from-scratch keys --
@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=30))
def test_long_texts_encode_to_the_same_ids(tok_dir: Path, piece: str) -> None:
    tok = HFTokenizer(tok_dir)
    text = (piece + "hello world ") * (GIL_FREE_CHARS // (len(piece) + 12) + 1)
    assert len(text) >= GIL_FREE_CHARS
    assert tok.encode(text) == tok._tok.encode(text, add_special_tokens=False).ids


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_streamed_text_equals_the_decoded_text(tok_dir: Path, text: str) -> None:
    """The worker's stream decoder (incremental, with offsets) emits exactly decode(all ids)."""
    tok = HFTokenizer(tok_dir)
    ids = tok.encode(text + " the quick brown fox")
    decoder = tok.stream_decoder()
    assert "".join(decoder.push(i) for i in ids) == tok.decode(ids)


def _processor(tok_dir: Path, block_size: int = 4) -> PromptProcessor:
    reg = WorkerRegistry(parse_config({}))
    reg.add(WorkerConfig(name="w", url="http://h:1", models=["m", "m2"], block_size=block_size,
                         tokenizer=str(tok_dir)))
    return PromptProcessor(reg)


turn_text = st.text(st.sampled_from(list("helo wrd\n<|>é👍\u200d\u0301\u05d0\0")), max_size=12)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(turn_text, st.sampled_from(["extend", "edit", "model"])), min_size=1, max_size=6))
async def test_session_chains_equal_from_scratch_keys_with_a_bpe_tokenizer(tok_dir: Path, turns: list[Any]) -> None:
    """Turn after turn of one session id (extended, edited, or sent for another model): every
    turn's keys equal those of a fresh tokenization of its whole prompt."""
    p = _processor(tok_dir)
    tok = HFTokenizer(tok_dir)
    messages: list[dict[str, Any]] = []
    for i, (text, how) in enumerate(turns):
        if how == "edit" and messages:
            messages[0] = {"role": "user", "content": text + messages[0]["content"]}
        else:
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        model = "m2" if how == "model" else "m"
        raw = json.dumps({"model": model, "messages": messages, "user": "one-session"}).encode()
        parsed = await p.process(raw, "chat", None)
        fresh = tok.encode(tok.render_chat(messages))
        assert parsed.info.prompt_tokens == len(fresh)
        assert list(parsed.info.block_keys) == block_keys(fresh, 4, namespace_seed(model))
        # a completion session: raw text extended turn by turn, BPE merging across the boundary
        prompt = "".join(m["content"] for m in messages)
        raw = json.dumps({"model": model, "prompt": prompt, "user": "text-session"}).encode()
        parsed = await p.process(raw, "completion", None)
        assert list(parsed.info.block_keys) == block_keys(tok.encode(prompt), 4, namespace_seed(model))


async def test_a_tokenizer_that_fails_to_load_is_not_reloaded_by_every_request(tmp_path: Path, tok_dir: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import mesh.request.prompt

    broken = tmp_path / "tokenizer.json"
    good = (tok_dir / "tokenizer.json").read_text()
    broken.write_text(good[:-50])  # cut short, as a copy caught halfway
    loads: list[str | None] = []

    def counting_load(spec: str | None) -> Any:
        loads.append(spec)
        return load_tokenizer(spec)

    monkeypatch.setattr(mesh.request.prompt, "load_tokenizer", counting_load)
    reg = WorkerRegistry(parse_config({}))
    reg.add(WorkerConfig(name="w", url="http://h:1", models=["m"], tokenizer=str(broken)))
    p = PromptProcessor(reg)
    now = [100.0]
    p.clock = lambda: now[0]
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()
    for _ in range(5):
        with pytest.raises(MeshError) as err:
            await p.process(raw, "chat", None)
        assert err.value.status == 503 and err.value.code == "tokenizer_unavailable"
    assert len(loads) == 1
    broken.write_text(good)  # repaired: used once the retry interval has passed
    now[0] += TOKENIZER_RETRY_S + 1
    assert (await p.process(raw, "chat", None)).info.prompt_tokens > 0
    assert len(loads) == 2


# -- through a real gateway --
def _gateway(procs: ProcessGroup, tmp: Path, workers: list[dict[str, Any]]) -> str:
    port = free_port()
    config = {"server": {"admin_key": "adm"}, "workers": workers, "health": {"interval_s": 0.3, "timeout_s": 1}}
    path = tmp / f"mesh-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return procs.gateway(path, port=port).url


@pytest.fixture(scope="module")
def echo_gateway(module_procs: ProcessGroup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A gateway over one echo worker, tokenizing with a BPE tokenizer.json whose template concatenates."""
    tmp = tmp_path_factory.mktemp("echo-gw")
    tok_dir = build_tokenizer(tmp / "tok", CONCAT, saved_limits=True)
    echo = module_procs.echo_worker("e0", "--model", "m")
    url = _gateway(module_procs, tmp, [{"name": "e0", "url": echo.url, "tokenizer": str(tok_dir), "models": ["m"]}])
    yield url, tok_dir


def test_a_template_that_raises_on_client_data_is_a_400_not_a_500(echo_gateway: tuple[str, Path]) -> None:
    url, _ = echo_gateway
    bad = {"model": "m", "messages": [{"role": "tool", "tool_call_id": None, "content": "hi"}], "max_tokens": 2}
    for path in ("/debug/route", "/v1/chat/completions"):
        r = httpx.post(url + path, json=bad, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_messages" and "TypeError" in err["message"] and err["param"] == "messages"
    good = {"model": "m", "messages": [{"role": "tool", "tool_call_id": "c1", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url + "/v1/chat/completions", json=good, timeout=30).status_code == 200


def test_a_tokenizer_json_saved_with_truncation_and_padding_counts_every_token(echo_gateway: tuple[str, Path]) -> None:
    """The gateway's tokenizer.json is saved with truncation at 8 and padding to 12: the gateway
    counts every token of the prompt as transformers (vLLM) does, not 8-12 tokens (one key for
    every prompt, and max_prompt_tokens never reached)."""
    from transformers import AutoTokenizer

    url, tok_dir = echo_gateway
    messages = [{"role": "user", "content": "hello world the quick brown fox " * 20}]
    rendered = HFTokenizer(tok_dir).render_chat(messages)
    expected = len(AutoTokenizer.from_pretrained(str(tok_dir)).encode(rendered, add_special_tokens=False))
    r = httpx.post(url + "/debug/route", json={"model": "m", "messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["request"]["prompt_tokens"] == expected > 100


def test_a_huge_prompt_with_a_tokenizer_json_does_not_stall_the_event_loop(echo_gateway: tuple[str, Path]) -> None:
    """~4 MB of text (over a second of BPE) to /debug/route; once its last byte is sent, 100
    /health requests, one after another, are all answered before its reply (an ordering, not a
    timing: a tokenizer holding the GIL for the whole prompt would let the loop answer nothing
    until it was done)."""
    url, _ = echo_gateway
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello world " * 330_000}]}).encode()
    uploaded, done = threading.Event(), threading.Event()
    result: dict[str, Any] = {}

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(raw), 1 << 20):
            yield raw[i : i + (1 << 20)]
        uploaded.set()

    def send_big() -> None:
        try:
            result["response"] = httpx.post(url + "/debug/route", content=chunks(), timeout=120)
        finally:
            done.set()

    thread = threading.Thread(target=send_big)
    thread.start()
    assert uploaded.wait(60)
    with httpx.Client(timeout=120) as client:
        statuses = [client.get(url + "/health").status_code for _ in range(100)]
    answered_first = not done.is_set()
    thread.join()
    assert statuses == [200] * 100
    assert result["response"].status_code == 200, result["response"].text
    assert result["response"].json()["request"]["prompt_tokens"] > 600_000
    assert answered_first, "the big prompt's reply came before 100 /health answers: the loop stalled"


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def test_an_image_part_is_routed_on_the_text_before_it_and_forwarded(echo_gateway: tuple[str, Path]) -> None:
    """OpenAI's image_url part (vLLM serves it on a vision model): the gateway cannot render what
    the engine makes of it, so it routes on the messages before it and lets the worker decide."""
    url, tok_dir = echo_gateway
    head = [{"role": "system", "content": "hello world the quick brown fox " * 4}]
    messages = [*head, {"role": "user", "content": [{"type": "text", "text": "what is this?"}, IMAGE]}]
    r = httpx.post(url + "/debug/route", json={"model": "m", "messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    tok = HFTokenizer(tok_dir)
    expected = len(tok.encode(tok.render_chat(head, ChatOptions(add_generation_prompt=False))))
    assert r.json()["request"]["prompt_tokens"] == expected and r.json()["request"]["blocks"] == expected // 16
    forwarded = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages}, timeout=30)
    assert forwarded.headers.get("x-mesh-worker") == "e0"  # the worker's own answer (the echo worker refuses images)
    malformed = {"model": "m", "messages": [{"role": "user", "content": [{"text": "no type"}]}]}  # still the 400
    assert httpx.post(url + "/debug/route", json=malformed, timeout=30).status_code == 400


# -- the gateway's tokens equal the bundled worker's, for every message shape --
SHAPES: dict[str, list[dict[str, Any]]] = {
    "string": [{"role": "user", "content": "hello"}],
    "text parts": [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}],
    "system+developer+name": [{"role": "system", "content": "s", "name": "x"}, {"role": "developer", "content": "d"},
                              {"role": "user", "content": "u", "name": "bob"}],
    "tool calls, null content": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
    "unicode": [{"role": "user", "content": "a\u0000b e\u0301 \u05e9\u05dc\u05d5\u05dd \u202e 👩\u200d👩\u200d👧 \U0010ffff"}],
}


@pytest.fixture(scope="module")
def bundled(module_procs: ProcessGroup, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    workers = start_workers(module_procs, ["b0"])
    url = _gateway(module_procs, tmp_path_factory.mktemp("bundled-gw"), [workers["b0"].config()])
    return url, workers["b0"].proc.url


def _gpu_overlap(explained: dict[str, Any]) -> int:
    return max(c["overlap"]["gpu_blocks"] for c in explained["candidates"].values())


@pytest.mark.parametrize("shape", list(SHAPES))
def test_gateway_tokens_equal_the_bundled_workers_and_turn_two_reuses_turn_one(bundled: tuple[str, str], shape: str) -> None:
    """Same token count as the worker's /tokenize; after turn 1 the index (fed by the worker's KV
    events, keyed from the engine's tokens) matches every full block of the gateway's keys, and
    turn 2 (turn 1 + the reply + a new user message) is served with those blocks cached."""
    gateway, worker = bundled
    messages = SHAPES[shape]
    theirs = httpx.post(worker + "/tokenize", json={"messages": messages}, timeout=30).json()
    turn1 = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
    ours = httpx.post(gateway + "/debug/route", json=turn1, timeout=30).json()["request"]
    assert ours["prompt_tokens"] == theirs["count"]
    full = ours["blocks"]
    assert full == theirs["count"] // 16 and full > 0
    reply = httpx.post(gateway + "/v1/chat/completions", json=turn1, timeout=60).json()["choices"][0]["message"]
    turn2 = {**turn1, "messages": [*messages, reply, {"role": "user", "content": "and then?"}]}
    wait_until(lambda: _gpu_overlap(httpx.post(gateway + "/debug/route", json=turn2, timeout=30).json()["decision"]) >= full,
               timeout_s=10, what=f"the index matching turn 1's {full} blocks")
    usage = httpx.post(gateway + "/v1/chat/completions", json=turn2, timeout=60).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= full * 16


def test_an_image_turn_still_matches_the_text_turns_before_it(bundled: tuple[str, str]) -> None:
    gateway, _ = bundled
    text_turn = [{"role": "system", "content": "you look at pictures " * 3}, {"role": "user", "content": "ready?"}]
    turn1 = {"model": "tiny", "messages": text_turn, "max_tokens": 2, "temperature": 0}
    full = httpx.post(gateway + "/debug/route", json=turn1, timeout=30).json()["request"]["blocks"]
    reply = httpx.post(gateway + "/v1/chat/completions", json=turn1, timeout=60).json()["choices"][0]["message"]
    image_turn = {**turn1, "messages": [*text_turn, reply, {"role": "user", "content": [IMAGE]}]}
    wait_until(lambda: _gpu_overlap(httpx.post(gateway + "/debug/route", json=image_turn, timeout=30).json()["decision"]) >= full,
               timeout_s=10, what=f"the image turn matching the text turn's {full} blocks")


def test_a_workers_tokenizer_is_loaded_when_it_joins_not_by_the_first_request(
        tok_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Parsing a large tokenizer.json holds the GIL for seconds: the gateway loads each worker's
    tokenizer as the worker joins (config, reload, admin API), and a broken one is logged then."""
    from mesh.gateway.app import build_gateway

    gateway = build_gateway(parse_config({"workers": [{"name": "w", "url": "http://h:1", "tokenizer": str(tok_dir)}]}))
    assert isinstance(gateway.prompts._tokenizers.get(str(tok_dir)), HFTokenizer)  # before any request
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{")
    with caplog.at_level("WARNING"):
        gateway.registry.add(WorkerConfig(name="b", url="http://h:2", tokenizer=str(broken)))
    assert any("cannot load tokenizer" in r.getMessage() for r in caplog.records)
