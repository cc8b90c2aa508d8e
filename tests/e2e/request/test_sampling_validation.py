"""Sampling parameters that are no number at all (NaN, +-inf) are refused where they are built.

Every comparison with NaN is false, so a range check written with ``<`` passes
``temperature=nan``, which would reach the sampler (logits / NaN: every probability NaN, the same
token forever); an infinite temperature too. The check sits in ``SamplingParams`` itself, not only
in the HTTP layer, so no other caller of the engine (a benchmark, the disaggregated path, a
future endpoint) can feed it one: the constructor raises ``ValueError`` naming the field, and
the server turns that into a 400 in OpenAI's error shape, over a real worker process.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import pytest

from tests.procs import PYTHON, ProcessGroup, free_port, wait_http
from workers.engine.sequence import InvalidSamplingParams, SamplingParams

NOT_NUMBERS = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", NOT_NUMBERS, ids=["nan", "inf", "-inf"])
def test_the_constructor_refuses_a_non_finite_float(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{field} must be a finite number") as caught:
        SamplingParams(**{field: value})
    assert isinstance(caught.value, InvalidSamplingParams) and caught.value.param == field


@pytest.mark.parametrize("field, value", [("top_k", 2.5), ("top_k", True), ("max_tokens", 1.0), ("max_tokens", None),
                                          ("seed", 1.5), ("temperature", "0.5"), ("temperature", True),
                                          ("stop_token_ids", (1.5,))])
def test_the_constructor_refuses_a_value_of_the_wrong_type(field: str, value: object) -> None:
    with pytest.raises(InvalidSamplingParams, match=field) as caught:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert caught.value.param == field


def test_valid_params_still_construct_and_ranges_are_checked_at_admission() -> None:
    ok = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_tokens=8, seed=3, stop_token_ids=(1, 2))
    ok.validate()
    assert SamplingParams(temperature=0).greedy  # an int temperature is a number too
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0).validate()  # a finite value out of range: refused by validate, as before


@pytest.fixture(scope="module")
def worker(module_procs: ProcessGroup) -> Iterator[str]:
    port = free_port()
    cmd = [PYTHON, "-m", "workers.server.cli", "--preset", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--num-kv-blocks", "64", "--cpu-threads", "1", "--max-model-len", "512", "--log-level", "warning"]
    proc = module_procs.start(cmd, name="tiny", port=port)
    wait_http(proc.url + "/health", proc=proc, timeout_s=120)
    yield proc.url


# JSON has no NaN or infinity, but Python's json (hence FastAPI) reads NaN/Infinity literals, and
# a number past the double range (1e999) is infinity in every parser.
RAW = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_non_finite_value_over_http_is_a_400_in_openai_shape(worker: str, route: str, field: str) -> None:
    prompt = '"prompt": "hello"' if route == "/v1/completions" else '"messages": [{"role": "user", "content": "hi"}]'
    with httpx.Client(base_url=worker, timeout=30) as http:
        for raw in RAW:
            body = '{"model": "tiny", %s, "max_tokens": 2, "%s": %s}' % (prompt, field, raw)
            resp = http.post(route, content=body, headers={"content-type": "application/json"})
            assert resp.status_code == 400, (raw, resp.text)
            error = resp.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert error["type"] == "invalid_request_error" and error["param"] == field, error
            assert f"{field} must be a finite number" in error["message"], error
        # the worker still serves: nothing reached the engine loop
        ok = '{"model": "tiny", %s, "max_tokens": 2, "%s": 0.5}' % (prompt, field)
        assert http.post(route, content=ok, headers={"content-type": "application/json"}).status_code == 200
