"""Oracles for the simulator: outcomes computed independently of its code.

- One worker, unbounded KV, requests served one at a time: the hit rate is the trace's ideal
  prefix reuse (a trie of id prefixes built here), on the whole Mooncake conversation trace.
- KV capacity of exactly one request: nothing survives to the next request: hit rate zero
  (and with room for two, reuse appears: the zero is the capacity's doing).
- A hand-built two-session trace: every TTFT and end-to-end latency equals the profile's
  formula, chunked prefill and cached context included.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from simulator.engine import SimConfig, Simulator, simulate
from simulator.profile import BUILTIN, DecodeTiming, PrefillTiming, Profile, with_overrides
from simulator.traces import LoadOptions, load_traces
from simulator.worker_model import CapacityError
from tests.procs import SHARED_TRACES

MOONCAKE = SHARED_TRACES / "mooncake" / "conversation_trace.jsonl"


def ideal_reuse(path: Path, block: int) -> float:
    """Token-weighted prefix reuse with an infinite cache, requests in file order.

    A request reuses its longest prefix of blocks seen in earlier requests (a trie keyed by
    (parent node, id), so equality means an equal id *prefix*), excluding its last token (an
    engine always computes it: at most (n - 1) // block blocks); only full blocks are cached.
    """
    trie: dict[tuple[int, int], int] = {}
    hit = total = 0
    for line in path.read_text().splitlines():
        row = json.loads(line)
        n, ids = row["input_length"], row["hash_ids"]
        node, depth = 0, 0
        for i in ids[: (n - 1) // block]:
            nxt = trie.get((node, i))
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        hit += depth * block
        total += n
        node = 0
        for i in ids[: n // block]:
            node = trie.setdefault((node, i), len(trie) + 1)
    return hit / total


def one_at_a_time(profile: Profile, **overrides: object) -> Profile:
    return with_overrides(profile, max_num_seqs=1, **overrides)


def test_unbounded_single_worker_reaches_the_ideal_reuse() -> None:
    expected = ideal_reuse(MOONCAKE, 512)
    assert 0.36 < expected < 0.38  # the paper's ~37%
    trace = load_traces([MOONCAKE])
    profile = one_at_a_time(BUILTIN["unit"], kv_blocks=0)
    result = simulate(trace, "round_robin", SimConfig(workers=1, profile=profile))
    got = result.hit.sum() / result.prompt.sum()
    assert got == expected


def session_trace(tmp_path: Path, rows: list[dict], block: int = 16) -> Path:
    path = tmp_path / "sessions.jsonl"
    head = {"format": "mesh-sessions", "version": 1, "block_size": block}
    path.write_text("\n".join(json.dumps(r) for r in [head, *rows]) + "\n")
    return path


def interleaved(tmp_path: Path) -> Path:
    """Two sessions, alternating, every request 4 blocks; a turn shares 3 blocks with its last."""
    rows = []
    for turn in range(4):
        for s, base in (("a", 100), ("b", 200)):
            ids = [base, base + 1, base + 2, base + 10 + turn]
            row = {"session": s, "input_tokens": 64, "output_tokens": 4, "hash_ids": ids}
            row.update({"t": 0.0 if s == "a" else 0.5} if turn == 0 else {"think_s": 0.5})
            rows.append(row)
    return session_trace(tmp_path, rows)


def test_capacity_of_one_request_gives_zero_hits(tmp_path: Path) -> None:
    trace = load_traces([interleaved(tmp_path)])
    # one request holds blocks(64 prompt + 4 generated tokens) = 5 blocks of 16
    one = with_overrides(BUILTIN["unit"], kv_blocks=5, block_size=16, max_num_seqs=1)
    sim = Simulator(trace, "round_robin", SimConfig(workers=1, profile=one))
    result = sim.run()
    sim.workers[0].check()
    assert result.hit.sum() == 0 and (result.finish > 0).all()
    two = with_overrides(one, kv_blocks=10)
    reuse = simulate(trace, "round_robin", SimConfig(workers=1, profile=two))
    assert reuse.hit.sum() == 6 * 3 * 16  # every later turn finds its 3 shared blocks


def test_a_request_larger_than_the_cache_is_a_clear_error(tmp_path: Path) -> None:
    trace = load_traces([interleaved(tmp_path)])
    tiny = with_overrides(BUILTIN["unit"], kv_blocks=4, block_size=16)
    with pytest.raises(CapacityError, match="needs 5 KV blocks .* holds 4"):
        simulate(trace, "round_robin", SimConfig(workers=1, profile=tiny))


FORMULA = Profile(
    name="formula", block_size=16, kv_blocks=0, max_num_seqs=8, max_batched_tokens=96,
    prefill=PrefillTiming(base_ms=5.0, per_token_ms=0.01, per_token2_ms=1e-4, per_token_ctx_ms=2e-4),
    decode=DecodeTiming(base_ms=2.0, per_seq_ms=0.25, per_ctx_token_ms=1e-3, per_ctx_token2_ms=1e-7),
)


def expected_times(n: int, hit: int, out: int, p: Profile) -> tuple[float, float]:
    """TTFT and E2E (seconds) of a request alone on a worker, by the profile's formula."""
    budget, done, ttft = p.max_batched_tokens, hit, 0.0
    while done < n:
        chunk = min(budget, n - done)
        ttft += p.prefill_ms(chunk, done)
        done += chunk
    d = p.decode
    e2e = ttft
    for i in range(out - 1):  # one sequence decoding, its context growing from n + 1
        ctx = n + 1 + i
        e2e += d.base_ms + d.per_seq_ms + d.per_ctx_token_ms * ctx + d.per_ctx_token2_ms * ctx * ctx
    return ttft / 1e3, e2e / 1e3


def test_ttft_and_latency_follow_the_profile_formula(tmp_path: Path) -> None:
    rows = [
        {"session": "a", "t": 0.0, "input_tokens": 40, "output_tokens": 6, "hash_ids": [1, 2, 3]},
        {"session": "b", "t": 100.0, "input_tokens": 70, "output_tokens": 3, "hash_ids": [1, 2, 30, 31, 32]},
        {"session": "a", "think_s": 300.0, "input_tokens": 150, "output_tokens": 9,
         "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]},
        {"session": "b", "think_s": 500.0, "input_tokens": 250, "output_tokens": 1,
         "hash_ids": list(range(40, 56))},
    ]
    trace = load_traces([session_trace(tmp_path, rows)])
    result = simulate(trace, "round_robin", SimConfig(workers=1, profile=FORMULA))
    # hits: a1 none; b1 shares ids [1, 2]; a2 shares [1, 2, 3] but only 2 full blocks of a1
    # were cached (40 tokens = 2 full blocks); b2 shares nothing
    hits = [0, 32, 32, 0]
    assert list(result.hit) == hits
    for i, row in enumerate(rows):
        ttft, e2e = expected_times(row["input_tokens"], hits[i], max(1, row["output_tokens"]), FORMULA)
        assert result.first_token[i] - result.arrival[i] == pytest.approx(ttft, rel=1e-12, abs=1e-12)
        assert result.finish[i] - result.arrival[i] == pytest.approx(e2e, rel=1e-12, abs=1e-12)
    # closed loop: a later turn is released think_s after its session's previous turn finished
    assert result.arrival[2] == pytest.approx(result.finish[0] + 300.0)
    assert result.arrival[3] == pytest.approx(result.finish[1] + 500.0)


def test_concurrent_decode_batch_matches_stepwise_sum(tmp_path: Path) -> None:
    """Two sequences decoding together: the fast-forwarded segments equal a step-by-step sum."""
    rows = [
        {"t": 0.0, "input_tokens": 32, "output_tokens": 50, "hash_ids": [1, 2]},
        {"t": 0.0, "input_tokens": 48, "output_tokens": 20, "hash_ids": [5, 6, 7]},
    ]
    trace = load_traces([session_trace(tmp_path, rows)])
    result = simulate(trace, "round_robin", SimConfig(workers=1, profile=FORMULA))
    p, d = FORMULA, FORMULA.decode
    # step 1: both prompts prefilled together (80 tokens <= budget 96)
    t = (p.prefill.base_ms + p.prefill.per_token_ms * 80 + p.prefill.per_token2_ms * 80 * 80) / 1e3
    assert result.first_token[0] == pytest.approx(t) and result.first_token[1] == pytest.approx(t)
    ctx, g = [33, 49], [1, 1]
    outs = [50, 20]
    finish = [0.0, 0.0]
    while any(g[i] < outs[i] for i in range(2)):
        live = [i for i in range(2) if g[i] < outs[i]]
        c = sum(ctx[i] for i in live)
        t += (d.base_ms + d.per_seq_ms * len(live) + d.per_ctx_token_ms * c + d.per_ctx_token2_ms * c * c) / 1e3
        for i in live:
            g[i] += 1
            ctx[i] += 1
            if g[i] == outs[i]:
                finish[i] = t
    assert result.finish[0] == pytest.approx(finish[0], rel=1e-12)
    assert result.finish[1] == pytest.approx(finish[1], rel=1e-12)


def test_runs_are_deterministic_and_pressure_keeps_invariants() -> None:
    trace = load_traces([MOONCAKE], LoadOptions(max_requests=300, block_size=64, time_scale=0.05))
    tight = with_overrides(BUILTIN["dynamo-mocker"], kv_blocks=2000, **{"cpu.blocks": 6000,
                                                                         "cpu.load_ms_per_block": 0.05})
    runs = []
    for _ in range(2):
        sim = Simulator(trace, "power_of_two", SimConfig(workers=2, profile=tight, seed=7))
        checks = []
        sim.progress = lambda done, sim=sim: checks.append([w.check() for w in sim.workers])
        result = sim.run()
        for w in sim.workers:
            w.check()
        runs.append(result)
        assert checks  # invariants held at every progress point
    a, b = runs
    assert np.array_equal(a.worker, b.worker) and np.array_equal(a.finish, b.finish)
    assert a.preemptions > 0 and a.cpu_hit.sum() > 0  # the pressure paths really ran
    assert 0 < a.hit.sum() < a.prompt.sum()


def test_the_cpu_tier_never_exceeds_its_capacity() -> None:
    """An admission that borrows CPU blocks to reload and then finds no GPU room puts them back
    after its eviction has filled the tier: the tier is trimmed to its capacity (untrimmed, 10 such
    admissions would leave it up to 32 blocks over). The invariants (``check``, the CPU bound included)
    hold at every segment end, and the CPU bound after every admission."""
    trace = load_traces([MOONCAKE], LoadOptions(max_requests=1500, time_scale=0.02))
    profile = with_overrides(BUILTIN["h200-8b"], kv_blocks=8448, **{"cpu.blocks": 10000})
    sim = Simulator(trace, "kv_aware", SimConfig(workers=3, profile=profile))
    over: list[tuple[str, int]] = []
    segments = [0]
    for w in sim.workers:
        def admit(req, t, w=w, inner=w._admit):  # type: ignore[no-untyped-def]
            out = inner(req, t)
            if len(w.cpu) > w.cpu_capacity:
                over.append((w.id, len(w.cpu) - w.cpu_capacity))
            return out

        def complete(t, w=w, inner=w.complete):  # type: ignore[no-untyped-def]
            inner(t)
            segments[0] += 1
            w.check()

        w._admit, w.complete = admit, complete  # type: ignore[method-assign]
    result = sim.run()
    assert over == []
    assert segments[0] > 1000 and result.preemptions > 0 and result.cpu_hit.sum() > 0  # the pressure paths ran
    assert sim.workers[0].cpu_capacity < 10000  # 10,000 16-token blocks in the trace's 512-token blocks


PD_POLICY = {"name": "pipeline", "params": {"profiles": {
    "prefill": {"scorers": [{"name": "prefix", "weight": 1.0}]},
    "decode": {"scorers": [{"name": "load", "weight": 1.0}]},
}}}


def test_prefill_decode_pair_puts_the_kv_transfer_in_ttft(tmp_path: Path) -> None:
    """As the relay serves a pair (docs/disaggregation.md): the prefill's own token is discarded,
    the decode worker pulls the (n - 1) // block_size exported blocks, computes the last block
    and streams the client's first token. So TTFT = prefill + transfer + that step, and the
    transfer is not in the ITL (TTFT is not stamped at the prefill's token)."""
    rows = [{"t": 0.0, "input_tokens": 64, "output_tokens": 5, "hash_ids": [1, 2, 3, 4]}]
    trace = load_traces([session_trace(tmp_path, rows)])
    profile = with_overrides(FORMULA, **{"pd.transfer_base_ms": 3.0, "pd.transfer_ms_per_block": 0.5})
    sim = Simulator(trace, PD_POLICY, SimConfig(workers=2, profile=profile, prefill_workers=1))
    result = sim.run()
    prefill_s = profile.prefill_ms(64) / 1e3
    transfer_s = (3.0 + 0.5 * 3) / 1e3  # blocks 0-2 move; block 3 holds the last token
    last_block_s = profile.prefill_ms(16, 48) / 1e3  # computed by the decode worker
    ttft = prefill_s + transfer_s + last_block_s
    _, e2e_alone = expected_times(64, 0, 5, profile)  # the same decode steps as a mixed worker's
    assert result.first_token[0] == pytest.approx(ttft, rel=1e-12)
    assert result.finish[0] == pytest.approx(ttft + e2e_alone - prefill_s, rel=1e-12)
    prefill, decode = sim.workers
    assert result.worker[0] == 0 and result.pairs == 1 and prefill.steps == 1 and decode.steps == 1 + 4
    assert decode.cached_blocks == 4  # 3 imported + the one it computed
    for w in sim.workers:
        w.check()
        assert w.state.in_flight == 0 and w.state.prefill_tokens == 0 and w.state.decode_tokens == 0


def test_the_decode_worker_pulls_only_the_blocks_it_lacks(tmp_path: Path) -> None:
    """The real decode worker pins the prefix it caches and pulls only the rest, and the transfer
    time charges only the blocks pulled, not every block of the prompt. The second request shares
    6 of 8 blocks with the first, which the decode worker then caches: 7 exported, 6 held, 1
    pulled."""
    rows = [{"t": 0.0, "input_tokens": 128, "output_tokens": 2, "hash_ids": list(range(8))},
            {"t": 1.0, "input_tokens": 128, "output_tokens": 2, "hash_ids": [*range(6), 50, 51]}]
    trace = load_traces([session_trace(tmp_path, rows)])
    profile = with_overrides(FORMULA, **{"pd.transfer_base_ms": 0.0, "pd.transfer_ms_per_block": 10.0})
    sim = Simulator(trace, PD_POLICY, SimConfig(workers=2, profile=profile, prefill_workers=1))
    result = sim.run()
    # request 1: its prefill hits 6 blocks (96 tokens) on the prefill worker, then 10 ms for one
    # block, then the decode worker computes its last block over 112 cached tokens
    ttft = (profile.prefill_ms(32, 96) + 10.0 + profile.prefill_ms(16, 112)) / 1e3
    assert result.hit[1] == 96
    assert result.first_token[1] - result.arrival[1] == pytest.approx(ttft, rel=1e-12)
    assert sim.transferred_blocks == 7 + 1
