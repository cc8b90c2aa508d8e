"""``mesh calibrate``: measure a running OpenAI-compatible endpoint and fit a timing profile.

What it measures (streaming ``/v1/completions``; every prompt starts with a random nonce so no
measurement reuses another's prefix cache, except where a cached context is the point):

1. Prefill: TTFT of cold prompts of growing length, ``max_tokens=1``.
2. Cached context: a prompt of ``C`` tokens is sent once (warming the cache), then again
   extended by ``n`` new tokens.
   Both fit the prefill terms at once (``fit_prefill``: non-negative least squares,
   ``simulator.fit``; a TTFT that rises with the prompt always gets a positive per-token cost),
   each TTFT priced as the engine runs it, in steps of the profile's ``max_batched_tokens``:
   ``base + per_token * c + per_token2 * c^2 + per_token_ctx * c * (tokens before the step)``
   per step of ``c`` tokens, ``per_hit_token`` per cached token. A cold prompt of two steps
   measures the attention of the second over the first, which a small cached context cannot.
3. Decode: ``B`` concurrent streams of ``M`` tokens, a few times over; the median over streams
   and repeats of a stream's mean inter-token time (the chunks read in one burst with its first,
   after a stall, left out: ``simulator.calibrate_itl``) is the step time at batch ``B``
   (fit ``base + per_seq * B``), and at batch 1 with a long prompt it gives ``per_ctx_token``.

Token counts come from the endpoint's ``usage`` (``stream_options.include_usage``), or, when it
does not report usage, from a non-streaming probe of a same-shaped prompt.

Every cost is fitted or named as not fitted, with the reason (too few points, not measured,
non-positive slope: ``calibration.unfitted`` in the profile, and the summary printed). The KV
capacity is the worker's (``mesh.commands.calibrate_capacity``), ``--kv-blocks``, or, with a
warning, the base profile's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

from simulator.calibrate_fit import CalibrationError, fit_decode_terms, fit_mixed_terms, fit_prefill_terms
from simulator.calibrate_itl import stream_itl
from simulator.calibrate_summary import WorkerCapacity, resolve_capacity, summary_lines
from simulator.fit import fit_terms
from simulator.profile import BUILTIN, DecodeTiming, PrefillTiming, ProfileError, dump_profile

__all__ = ["CalibrationError", "WorkerCapacity", "calibrate", "resolve_capacity"]


@dataclass(frozen=True, slots=True)
class StreamStats:
    ttft: float  # s from sending to the first token's chunk
    later: list[float]  # arrivals of the later chunks, s after the first
    prompt_tokens: int | None  # from usage, when the endpoint reports it
    completion_tokens: int | None
    cached_tokens: int | None

    def itl(self, max_tokens: int) -> float | None:
        """Mean inter-token time past the chunks read in one burst with the first; None when most
        of the stream came in that burst (``simulator.calibrate_itl``)."""
        return stream_itl(self.later, self.completion_tokens, max_tokens)


class Endpoint:
    def __init__(self, url: str, model: str | None, api_key: str | None, timeout: float,
                 session: str | None = None, session_header: str = "x-session-id") -> None:
        import httpx

        self.base = url.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if session:  # behind a session-aware gateway: every measurement lands on one worker
            headers[session_header] = session
        self.client = httpx.AsyncClient(base_url=self.base, headers=headers, timeout=timeout)
        self.model = model
        self.usage_in_stream = True
        # max_tokens of TTFT measurements: a request that goes on decoding after its first token
        # (the usual case) can see that token later than one that ends with it
        self.ttft_tokens = 1
        self.vocab = 0  # > 0: prompts are random token ids below it (--token-ids), not text
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

    async def stream(self, prompt: Any, max_tokens: int) -> tuple[float, list[float], int | None]:
        """(TTFT s, arrival times of later chunks relative to the first, prompt tokens)."""
        st = await self.stream_stats(prompt, max_tokens)
        return st.ttft, st.later, st.prompt_tokens

    async def stream_stats(self, prompt: Any, max_tokens: int) -> StreamStats:
        """One streamed completion: every chunk with a choice counts as a token's arrival (also
        one whose text is empty: a byte-level tokenizer may hold back a partial character)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first: float | None = None
        later: list[float] = []
        usage: dict[str, Any] = {}
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
                        usage = chunk["usage"]
                    if not chunk.get("choices"):
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
        details = usage.get("prompt_tokens_details") or {}
        return StreamStats(first - start, later, usage.get("prompt_tokens"), usage.get("completion_tokens"),
                           details.get("cached_tokens"))

    async def count_tokens(self, prompt: str) -> int:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1}
        r = await self.client.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise CalibrationError(f"{self.base}/v1/completions: HTTP {r.status_code}: {r.text[:300]}")
        usage = r.json().get("usage") or {}
        if "prompt_tokens" not in usage:
            raise CalibrationError(f"{self.base}: responses carry no usage.prompt_tokens; cannot size prompts")
        return int(usage["prompt_tokens"])


_rng = random.Random(1234)
DECODE_ROUNDS = 3  # runs of each decode point (one stall spoils a run, not the median)


Prompt = Any  # text, or a list of token ids (``--token-ids``)


def _ids(vocab: int, tokens: int) -> list[int]:
    return [_rng.randrange(vocab) for _ in range(max(1, tokens))]


def _short(ep: Endpoint) -> Prompt:
    """A fresh short prompt (~40 tokens) for decode measurements."""
    return _ids(ep.vocab, 40) if ep.vocab else _text(32)


async def _extend(ep: Endpoint, context: Prompt, tokens: int) -> Prompt:
    """``context`` followed by about ``tokens`` fresh tokens."""
    if ep.vocab:
        return context + _ids(ep.vocab, tokens)
    extra = await _sized_prompt(ep, tokens)
    return context + " " + extra.split(" ", 1)[1]


def _text(words: int, nonce: str | None = None) -> str:
    head = nonce or f"n{_rng.getrandbits(48):x}"
    return head + " " + " ".join(f"w{_rng.randrange(10_000)}" for _ in range(words))


async def _sized_prompt(ep: Endpoint, tokens: int) -> Prompt:
    """A fresh prompt of about ``tokens`` tokens (words-per-token learnt once by a probe), or
    exactly ``tokens`` random token ids with ``--token-ids``."""
    if ep.vocab:
        return _ids(ep.vocab, tokens)
    if ep.words_per_token is None:
        probe = _text(64)  # short enough for any context window (a byte tokenizer makes ~6 tokens a word)
        ep.words_per_token = 64 / max(1, await ep.count_tokens(probe))
    return _text(max(1, int(tokens * ep.words_per_token)))


async def _ttft(ep: Endpoint, prompt: str, repeats: int) -> float:
    samples = [(await ep.stream(prompt if i == 0 else _reseed(prompt, ep.vocab), ep.ttft_tokens))[0]
               for i in range(repeats)]
    return statistics.median(samples)


def _reseed(prompt: Prompt, vocab: int = 0) -> Prompt:
    if isinstance(prompt, list):  # a fresh first block: nothing of it is cached
        return _ids(vocab, 4) + prompt[4:]
    return f"n{_rng.getrandbits(48):x}" + prompt[prompt.index(" "):]


async def _measure(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    ep = Endpoint(args.url, args.model, args.api_key, args.timeout,
                  getattr(args, "session", None), getattr(args, "session_header", "x-session-id"))
    try:
        model = await ep.resolve_model()
        ep.ttft_tokens = max(1, getattr(args, "ttft_max_tokens", 1))
        ep.vocab = max(0, getattr(args, "token_ids", None) or 0)
        log(f"model {model} at {ep.base}")
        quick = args.quick
        repeats = 1 if quick else max(1, args.repeats)
        top = min(args.max_prompt, 512 if quick else args.max_prompt)
        lengths = sorted({n for n in (16, 64, 256, 1024, 2048, 4096, 8192, 16384) if n <= top} | {top})
        prefill_pts = []
        for n in lengths:
            prompt = await _sized_prompt(ep, n)
            _, _, tokens = await ep.stream(_reseed(prompt, ep.vocab), 1)  # size it (and warm the kernels)
            tokens = tokens or n
            ttft = await _ttft(ep, _reseed(prompt, ep.vocab), repeats)
            prefill_pts.append((tokens, ttft))
            log(f"prefill {tokens:>6} tokens: TTFT {ttft * 1e3:8.2f} ms")
        cold = fit_terms(("base", "per_token", "per_token2"), [[1.0, n, n * n] for n, _ in prefill_pts],
                         [t for _, t in prefill_pts]).values
        block_size = getattr(args, "resolved_block_size", None) or args.block_size or BUILTIN[args.base].block_size

        cold_fit = (cold["base"], cold["per_token"], cold["per_token2"])
        ctx_pts = await _context_points(ep, top, repeats, cold_fit, block_size, log)
        # every TTFT at once, priced in the engine's steps (the simulator chunks at the profile's budget)
        prefill = fit_prefill_terms(prefill_pts, ctx_pts, BUILTIN[args.base].max_batched_tokens)

        steps = 16 if quick else 64
        decode_pts, decode_ctx_pts = await _decode_points(ep, top, steps, 4 if quick else args.max_batch, quick, log)
        if not decode_pts:
            raise CalibrationError("no inter-token gaps measured: does the endpoint stream token by token?")
        decode = fit_decode_terms(decode_pts, decode_ctx_pts)
        d = decode.values
        mixed_pts = await _mixed_points(ep, top, repeats, quick, (d["base"], d["per_seq"], d["per_ctx_token"]), log)
        mixed = fit_mixed_terms(mixed_pts)
        unfitted = {f"prefill.{k}": v for k, v in prefill.unfitted.items()}
        unfitted |= {f"prefill.{k}": v for k, v in mixed.unfitted.items()}
        unfitted |= {f"decode.{k}": v for k, v in decode.unfitted.items()}
        return {
            "model": model, "url": ep.base,
            "prefill": {f"{k}_ms": v * 1e3 for k, v in (prefill.values | mixed.values).items()},
            "decode": {f"{k}_ms": v * 1e3 for k, v in d.items()},
            "unfitted": unfitted,
            "points": {"prefill": prefill_pts, "context": ctx_pts, "decode": [(b, t) for b, t, _ in decode_pts],
                       "decode_context": decode_ctx_pts, "mixed": mixed_pts},
        }
    finally:
        await ep.close()


async def _context_points(ep: Endpoint, top: int, repeats: int, cold_fit: tuple[float, float, float],
                          block_size: int, log: Any) -> list[tuple[int, int, float, float]]:
    """(cached tokens C, new tokens n, TTFT, cold-fit TTFT of n) for prompts extending a cached
    context: by about C/4 tokens (attention of new tokens over the context) and by a few tokens
    (what C cached tokens cost on their own: parsing, hashing, prefix lookup)."""
    base, per_tok, per_tok2 = cold_fit
    sizes = [c for c in (256, 1024, 4096, 16384) if c + c // 4 <= top] or [max(8, top // 4)]
    points = []
    for ctx in sizes:
        context = await _sized_prompt(ep, ctx)
        warm = await ep.stream_stats(context, 1)  # the engine caches it
        ctx_tokens = warm.prompt_tokens or ctx
        for ext_tokens in (max(8, ctx // 4), 16):
            samples = []
            for _ in range(repeats):
                st = await ep.stream_stats(await _extend(ep, context, ext_tokens), ep.ttft_tokens)
                cached = st.cached_tokens if st.cached_tokens is not None else ctx_tokens // block_size * block_size
                new = (st.prompt_tokens or ctx_tokens + ext_tokens) - cached
                samples.append((st.ttft, cached, new))
            t, cached, new = sorted(samples)[len(samples) // 2]
            cold = base + per_tok * new + per_tok2 * new * new
            points.append((cached, new, t, cold))
            log(f"context {cached:>6} + {new:>5} new tokens: TTFT {t * 1e3:8.2f} ms (cold fit {cold * 1e3:.2f} ms)")
    return points


async def _decode_points(ep: Endpoint, top: int, steps: int, max_batch: int, quick: bool, log: Any,
                         rounds: int = DECODE_ROUNDS) -> tuple[list[tuple[int, float, int]], list[tuple[int, float]]]:
    """Decode step times: ``(batch, ITL, KV tokens of the batch)`` for concurrent short prompts,
    and ``(context tokens, ITL)`` for one stream on long prompts; each the median over
    ``rounds`` runs of every stream that was not read coalesced (a point without one is left
    out, and said)."""
    batch_pts = []
    for b in [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= max_batch]:
        runs: list[StreamStats] = []
        for _ in range(rounds):
            runs += await asyncio.gather(*(ep.stream_stats(_short(ep), steps) for _ in range(b)))
        itl = _median_itl(runs, steps, f"decode batch {b:>4}", log)
        if itl is None:
            continue
        ctx = statistics.median(r.prompt_tokens or 40 for r in runs) * b + b * (steps // 2)
        batch_pts.append((b, itl, int(ctx)))
        log(f"decode batch {b:>4}: ITL {itl * 1e3:7.3f} ms")
    ctx_pts = []
    for c in [c for c in (1024, 4096, 16384) if c <= top] or [top]:
        runs = [await ep.stream_stats(await _sized_prompt(ep, c), steps) for _ in range(rounds)]
        itl = _median_itl(runs, steps, f"decode at {c} context tokens", log)
        if itl is None:
            continue
        tokens = int(statistics.median(r.prompt_tokens or c for r in runs)) + steps // 2
        ctx_pts.append((tokens, itl))
        log(f"decode at {tokens} context tokens: ITL {itl * 1e3:.3f} ms")
        if quick:
            break
    return batch_pts, ctx_pts


def _median_itl(runs: list[StreamStats], steps: int, what: str, log: Any) -> float | None:
    """The median ITL of the streams of ``runs`` that measured one; None (logged) when none did."""
    itls = [x for x in (r.itl(steps) for r in runs) if x is not None]
    if len(itls) < len(runs):
        log(f"{what}: {len(runs) - len(itls)} of {len(runs)} streams measured no inter-token time (under 2 tokens, "
            f"or most read in one burst with the first, after a stall), not counted")
    return statistics.median(itls) if itls else None


async def _mixed_points(ep: Endpoint, top: int, repeats: int, quick: bool, decode: tuple[float, float, float],
                        log: Any) -> list[tuple[int, int, float, float]]:
    """``(B, prompt tokens P, TTFT excess, TTFT)`` of a cached-context prompt sent while ``B``
    other streams decode.

    The excess is what the prompt's TTFT gains over the same measurement with nothing running,
    beyond what the step model already charges: waiting half a decode step on average, then the
    decode part of the mixed step (1.5 decode steps in all). In a Python engine it is mostly the
    server's and the engine's threads contending (streaming chunks while taking in the new
    request, whose parsing and hashing grow with its prompt), hence two prompt sizes."""
    d_base, d_seq, d_ctx = decode
    sizes = [min(4096, max(64, top // 2))] if quick else sorted({min(1024, top // 2), min(8192, top // 2)})
    probes = max(3, repeats) + (0 if quick else 2)
    points = []
    for ctx in sizes:
        context = await _sized_prompt(ep, ctx)
        warm = await ep.stream_stats(context, 1)
        tokens = (warm.prompt_tokens or ctx) + 16

        async def ttft() -> float:
            samples = []
            for _ in range(probes):
                samples.append((await ep.stream_stats(await _extend(ep, context, 16), ep.ttft_tokens)).ttft)
                await asyncio.sleep(0.003)  # land at different phases of the background's steps
            return statistics.median(samples)

        quiet = await ttft()
        for b in (1, 2) if quick else (1, 2, 4, 8):
            steps = 4096  # background streams far outlive the probes; cancelled (aborted) after them
            background = [asyncio.ensure_future(ep.stream_stats(_short(ep), steps)) for _ in range(b)]
            await asyncio.sleep(0.25)  # past their prefill: decoding
            try:
                loaded = await ttft()
            finally:
                for task in background:
                    task.cancel()
                await asyncio.gather(*background, return_exceptions=True)
            kv = b * 300  # the background's KV while probed: ~40 prompt + a few hundred generated tokens each
            excess = loaded - quiet - 1.5 * (d_base + d_seq * b + d_ctx * kv)
            points.append((b, tokens, excess, loaded))
            log(f"{tokens:>6}-token cached prompt, {b:>2} streams decoding: TTFT {loaded * 1e3:7.2f} ms "
                f"(alone {quiet * 1e3:.2f} ms, excess {excess * 1e3:+.2f} ms)")
    return points


def calibrate(args: argparse.Namespace, capacity: WorkerCapacity | None = None) -> dict[str, Any]:
    """Measure, fit and write the profile; ``capacity``: what the worker reported, if anything."""
    from rich.console import Console

    console = Console(stderr=True)
    if args.base not in BUILTIN:
        raise CalibrationError(f"unknown base profile {args.base!r} (built-in: {', '.join(BUILTIN)})")
    base = BUILTIN[args.base]
    block_size, kv_blocks, source = resolve_capacity(args, base, capacity)
    if source.startswith("base profile"):
        console.print(f"[yellow]warning:[/] the worker reported no KV capacity (its /metrics and /health); the "
                      f"profile keeps {base.name}'s {kv_blocks:,} blocks, not this worker's: pass --kv-blocks")
    args.resolved_block_size = block_size
    with console.status("calibrating"):
        fit = asyncio.run(_measure(args, lambda msg: console.log(msg)))
    profile = replace(
        base,
        name=f"calibrated-{fit['model']}".replace("/", "_"),
        description=f"measured by mesh calibrate at {fit['url']} on {time.strftime('%Y-%m-%d %H:%M')}",
        estimate=False,
        prefill=PrefillTiming(**fit["prefill"]),
        decode=replace(DecodeTiming(**fit["decode"])),
        block_size=block_size,
        kv_blocks=kv_blocks,
    )
    if profile.decode.base_ms + profile.decode.per_seq_ms <= 0:
        raise CalibrationError("decode timing fit to zero: too few or too noisy measurements")
    extra = {"url": fit["url"], "model": fit["model"], "kv_capacity_source": source, "unfitted": fit["unfitted"],
             "points": fit["points"]}
    try:
        dump_profile(profile, args.out, extra=extra)
    except (OSError, ProfileError) as exc:
        raise CalibrationError(f"cannot write {args.out}: {exc}") from None
    console.print(f"wrote {args.out}:", highlight=False)
    for line in summary_lines(profile, fit["unfitted"], source):
        console.print(f"  {line}", highlight=False, soft_wrap=True)
    return fit
