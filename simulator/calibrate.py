"""``mesh calibrate``: measure a running OpenAI-compatible endpoint and fit a timing profile.

What it measures (streaming ``/v1/completions``; every prompt starts with a random nonce so no
measurement reuses another's prefix cache, except where a cached context is the point):

1. Prefill: TTFT of cold prompts of growing length, ``max_tokens=1``. Fit
   ``base + per_token * n + per_token2 * n^2`` (least squares, coefficients clipped at 0).
2. Cached context: a prompt of ``C`` tokens is sent once (warming the cache), then again
   extended by ``n`` new tokens; the TTFT above the cold-prefill fit for ``n`` tokens, divided
   by ``n * C``, is ``per_token_ctx``.
3. Decode: ``B`` concurrent streams of ``M`` tokens; the median gap between a stream's chunks
   after its first is the step time at batch ``B`` (fit ``base + per_seq * B``), and at batch 1
   with a long prompt it gives ``per_ctx_token``.

Token counts come from the endpoint's ``usage`` (``stream_options.include_usage``), or, when it
does not report usage, from a non-streaming probe of a same-shaped prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import replace
from typing import Any

import numpy as np

from simulator.profile import BUILTIN, DecodeTiming, PrefillTiming, ProfileError, dump_profile


class CalibrationError(RuntimeError):
    """The endpoint could not be measured (unreachable, errors, no streaming)."""


class Endpoint:
    def __init__(self, url: str, model: str | None, api_key: str | None, timeout: float) -> None:
        import httpx

        self.base = url.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=self.base, headers=headers, timeout=timeout)
        self.model = model
        self.usage_in_stream = True
        self.words_per_token: float | None = None

    async def close(self) -> None:
        await self.client.aclose()

    async def resolve_model(self) -> str:
        if self.model:
            return self.model
        try:
            r = await self.client.get("/v1/models")
            r.raise_for_status()
            data = r.json().get("data") or []
        except Exception as exc:  # noqa: BLE001 - any transport or shape error is a clear message
            raise CalibrationError(f"{self.base}/v1/models: {exc}") from None
        if not data:
            raise CalibrationError(f"{self.base}/v1/models lists no model; pass --model")
        self.model = str(data[0]["id"])
        return self.model

    async def stream(self, prompt: str, max_tokens: int) -> tuple[float, list[float], int | None]:
        """(TTFT s, arrival times of later chunks relative to the first, prompt tokens)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first: float | None = None
        later: list[float] = []
        usage: int | None = None
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:300]
                    raise CalibrationError(f"{self.base}/v1/completions: HTTP {resp.status_code}: {text}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        usage = chunk["usage"].get("prompt_tokens")
                    choices = chunk.get("choices") or []
                    if not choices or not choices[0].get("text") and choices[0].get("finish_reason") is None:
                        continue
                    if first is None:
                        first = now
                    else:
                        later.append(now - first)
        except CalibrationError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CalibrationError(f"{self.base}/v1/completions: {type(exc).__name__}: {exc}") from None
        if first is None:
            raise CalibrationError(f"{self.base}: the stream produced no token")
        return first - start, later, usage

    async def count_tokens(self, prompt: str) -> int:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1}
        r = await self.client.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise CalibrationError(f"{self.base}/v1/completions: HTTP {r.status_code}")
        usage = r.json().get("usage") or {}
        if "prompt_tokens" not in usage:
            raise CalibrationError(f"{self.base}: responses carry no usage.prompt_tokens; cannot size prompts")
        return int(usage["prompt_tokens"])


_rng = random.Random(1234)


def _text(words: int, nonce: str | None = None) -> str:
    head = nonce or f"n{_rng.getrandbits(48):x}"
    return head + " " + " ".join(f"w{_rng.randrange(10_000)}" for _ in range(words))


async def _sized_prompt(ep: Endpoint, tokens: int) -> str:
    """A fresh prompt of about ``tokens`` tokens (words-per-token learnt once by a probe)."""
    if ep.words_per_token is None:
        probe = _text(400)
        ep.words_per_token = 400 / max(1, await ep.count_tokens(probe))
    return _text(max(1, int(tokens * ep.words_per_token)))


async def _ttft(ep: Endpoint, prompt: str, repeats: int) -> float:
    samples = [(await ep.stream(prompt if i == 0 else _reseed(prompt), 1))[0] for i in range(repeats)]
    return statistics.median(samples)


def _reseed(prompt: str) -> str:
    return f"n{_rng.getrandbits(48):x}" + prompt[prompt.index(" "):]


def _fit(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative least squares by clipping: good enough for 2-3 smooth terms."""
    a = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    for _ in range(a.shape[1]):
        neg = coef < 0
        if not neg.any():
            break
        keep = ~neg
        coef = np.zeros_like(coef)
        if keep.any():
            sub, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
            coef[keep] = sub
    return [max(0.0, float(c)) for c in coef]


async def _measure(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    ep = Endpoint(args.url, args.model, args.api_key, args.timeout)
    try:
        model = await ep.resolve_model()
        log(f"model {model} at {ep.base}")
        quick = args.quick
        repeats = 1 if quick else max(1, args.repeats)
        top = min(args.max_prompt, 512 if quick else args.max_prompt)
        lengths = sorted({n for n in (16, 64, 256, 1024, 2048, 4096, 8192, 16384) if n <= top} | {top})
        prefill_pts = []
        for n in lengths:
            prompt = await _sized_prompt(ep, n)
            _, _, tokens = await ep.stream(_reseed(prompt), 1)  # size it (and warm the kernels)
            tokens = tokens or n
            ttft = await _ttft(ep, _reseed(prompt), repeats)
            prefill_pts.append((tokens, ttft))
            log(f"prefill {tokens:>6} tokens: TTFT {ttft * 1e3:8.2f} ms")
        base, per_tok, per_tok2 = _fit([[1.0, n, n * n] for n, _ in prefill_pts], [t for _, t in prefill_pts])

        ctx_pts = []
        for ctx in [c for c in (256, 1024, 4096) if c * 2 <= top] or [max(8, top // 4)]:
            context = await _sized_prompt(ep, ctx)
            await ep.stream(context, 1)  # warm: the engine caches it
            extra = await _sized_prompt(ep, max(8, ctx // 4))
            t_ext, _, tokens = await ep.stream(context + " " + extra.split(" ", 1)[1], 1)
            new = (tokens or ctx + ctx // 4) - ctx
            cold = base + per_tok * new + per_tok2 * new * new
            ctx_pts.append((ctx, new, t_ext, cold))
            log(f"context {ctx:>6} + {new:>5} new tokens: TTFT {t_ext * 1e3:8.2f} ms (cold fit {cold * 1e3:.2f} ms)")
        per_ctx = max(0.0, float(np.median([(t - c) / (n * ctx) for ctx, n, t, c in ctx_pts if n > 0]))) \
            if ctx_pts else 0.0

        steps = 16 if quick else 64
        decode_pts = []
        batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= (4 if quick else args.max_batch)]
        for b in batches:
            prompts = [_text(32) for _ in range(b)]
            runs = await asyncio.gather(*(ep.stream(p, steps) for p in prompts))
            gaps = [g2 - g1 for _, later, _ in runs for g1, g2 in zip([0.0] + later[:-1], later)]
            if not gaps:
                continue
            itl = statistics.median(gaps)
            decode_pts.append((b, itl))
            log(f"decode batch {b:>4}: ITL {itl * 1e3:7.3f} ms")
        if not decode_pts:
            raise CalibrationError("no inter-token gaps measured: does the endpoint stream token by token?")
        d_base, d_seq = _fit([[1.0, b] for b, _ in decode_pts], [t for _, t in decode_pts])
        long_ctx = min(top, 4096)
        long_prompt = await _sized_prompt(ep, long_ctx)
        _, later, tokens = await ep.stream(long_prompt, steps)
        gaps = [g2 - g1 for g1, g2 in zip([0.0] + later[:-1], later)]
        per_ctx_tok = 0.0
        if gaps:
            itl_long = statistics.median(gaps)
            short = d_base + d_seq
            per_ctx_tok = max(0.0, (itl_long - short) / max(1, (tokens or long_ctx) - 40))
            log(f"decode at {tokens or long_ctx} context tokens: ITL {itl_long * 1e3:.3f} ms")
        return {
            "model": model, "url": ep.base,
            "prefill": {"base_ms": base * 1e3, "per_token_ms": per_tok * 1e3, "per_token2_ms": per_tok2 * 1e3,
                        "per_token_ctx_ms": per_ctx * 1e3},
            "decode": {"base_ms": d_base * 1e3, "per_seq_ms": d_seq * 1e3, "per_ctx_token_ms": per_ctx_tok * 1e3},
            "points": {"prefill": prefill_pts, "context": ctx_pts, "decode": decode_pts},
        }
    finally:
        await ep.close()


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console

    console = Console(stderr=True)
    if args.base not in BUILTIN:
        raise CalibrationError(f"unknown base profile {args.base!r} (built-in: {', '.join(BUILTIN)})")
    with console.status("calibrating"):
        fit = asyncio.run(_measure(args, lambda msg: console.log(msg)))
    base = BUILTIN[args.base]
    profile = replace(
        base,
        name=f"calibrated-{fit['model']}".replace("/", "_"),
        description=f"measured by mesh calibrate at {fit['url']} on {time.strftime('%Y-%m-%d %H:%M')}",
        estimate=False,
        prefill=PrefillTiming(**fit["prefill"]),
        decode=replace(DecodeTiming(**fit["decode"])),
        block_size=args.block_size or base.block_size,
        kv_blocks=args.kv_blocks if args.kv_blocks is not None else base.kv_blocks,
    )
    if profile.decode.base_ms + profile.decode.per_seq_ms <= 0:
        raise CalibrationError("decode timing fit to zero: too few or too noisy measurements")
    try:
        dump_profile(profile, args.out, extra={"url": fit["url"], "model": fit["model"], "points": fit["points"]})
    except (OSError, ProfileError) as exc:
        raise CalibrationError(f"cannot write {args.out}: {exc}") from None
    console.print(f"wrote {args.out}: prefill {profile.prefill.per_token_ms * 1e3:.2f} us/token, "
                  f"decode {profile.decode.base_ms:.2f} ms + {profile.decode.per_seq_ms:.3f} ms/seq")
    return fit
