"""Timing profile of one worker: how long a forward step takes, and how much KV it holds.

A step of continuous batching runs some prefill chunks and one decode token for every running
sequence. Its time is the sum of the parts present in it (all in milliseconds):

- prefill part (only when the step prefills tokens), for chunks ``n_i`` on cached contexts
  ``c_i`` (tokens already in KV before the chunk), ``N = sum(n_i)``::

      prefill.base_ms + prefill.per_token_ms * N + prefill.per_token2_ms * N**2
      + prefill.per_token_ctx_ms * sum(n_i * c_i) + prefill.per_hit_token_ms * H

  (linear compute, quadratic attention within the batch, attention over cached context, and
  ``H``: the prefix-cache hits, in tokens, of the requests the step admits); a step that also
  decodes adds ``prefill.mixed_ms + prefill.mixed_per_seq_ms * B + prefill.mixed_per_token_ms * P``
  (``P``: prompt tokens of the requests it admits);
- decode part (only when sequences decode), for ``B`` sequences holding ``C`` KV tokens::

      decode.base_ms + decode.per_seq_ms * B + decode.per_ctx_token_ms * C
      + decode.per_ctx_token2_ms * C**2

- CPU-tier reloads: ``cpu.load_ms_per_block`` per block restored in the step.

A prefill/decode pair moves a prompt's KV in ``pd.transfer_base_ms + pd.transfer_ms_per_block *
blocks``, ``blocks`` being the exported blocks (all full prompt blocks but the last token's) that
the decode worker does not already cache; both per-block costs are per profile block
(``block_size`` tokens, as ``kv_blocks``) and scale by tokens to the trace's blocks
(``per_block_ms_at``); the decode worker then computes the last block, and its
token is the client's first (the transfer is in TTFT). KV events reach the router's index
``event_lag_ms`` after the engine emits them.

Workers that share one device (``SimConfig.workers_per_device``) time-slice it: the
``prefill``/``decode`` timings are those of a worker alone on its device, and
``shared_prefill``/``shared_decode`` (same keys) those measured while ``shared_workers`` workers
were all busy on it (``bench/e2e_routing.py --calibrate``: every worker calibrated at once);
``simulator.device`` interpolates between the two by how many are busy. ``shared_workers: 0``:
not measured (then k busy workers each run at 1/k, fair time-slicing).

Profiles are YAML or JSON files with these keys (any omitted key keeps the built-in default's
value), or the name of a built-in profile. ``estimate: true`` marks numbers not yet measured on
the hardware they name (``mesh calibrate`` writes ``estimate: false``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from mesh.files import FileProblem, read_regular_file


class ProfileError(ValueError):
    """A profile file or name that cannot be used (message names the file and the key)."""


@dataclass(frozen=True, slots=True)
class PrefillTiming:
    base_ms: float = 0.0
    per_token_ms: float = 0.0
    per_token2_ms: float = 0.0
    per_token_ctx_ms: float = 0.0
    # per prompt token found cached, charged once in the step that admits the request: what a
    # cached prefix costs without compute (the request's parsing and block hashing, the lookup)
    per_hit_token_ms: float = 0.0
    # a step that prefills while sequences decode costs this much more than its prefill and
    # decode parts (plus mixed_per_seq_ms per decoding sequence): what the mix costs a real
    # engine beyond the sum (eager decodes, server and engine threads contending)
    mixed_ms: float = 0.0
    mixed_per_seq_ms: float = 0.0
    mixed_per_token_ms: float = 0.0  # per prompt token of the requests such a step admits


@dataclass(frozen=True, slots=True)
class DecodeTiming:
    base_ms: float = 0.0
    per_seq_ms: float = 0.0
    per_ctx_token_ms: float = 0.0
    per_ctx_token2_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class CpuTier:
    blocks: int = 0  # 0 = no CPU offload tier
    load_ms_per_block: float = 0.0


@dataclass(frozen=True, slots=True)
class PdTransfer:
    transfer_base_ms: float = 0.0
    transfer_ms_per_block: float = 0.0


@dataclass(frozen=True, slots=True)
class Profile:
    name: str = "custom"
    description: str = ""
    estimate: bool = True
    block_size: int = 16  # the engine's block size: kv_blocks are counted in these
    kv_blocks: int = 0  # GPU KV capacity in blocks; 0 = unbounded
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192  # token budget of one step (chunked prefill)
    event_lag_ms: float = 0.0
    prefill: PrefillTiming = field(default_factory=PrefillTiming)
    decode: DecodeTiming = field(default_factory=DecodeTiming)
    cpu: CpuTier = field(default_factory=CpuTier)
    pd: PdTransfer = field(default_factory=PdTransfer)
    shared_workers: int = 0  # busy workers on one device when shared_* were measured (0: not measured)
    shared_prefill: PrefillTiming = field(default_factory=PrefillTiming)
    shared_decode: DecodeTiming = field(default_factory=DecodeTiming)

    @property
    def kv_tokens(self) -> int:
        """GPU KV capacity in tokens (0 = unbounded)."""
        return self.kv_blocks * self.block_size

    def blocks_at(self, block_size: int) -> int:
        """GPU capacity in blocks of another size (0 = unbounded); at least one block."""
        if self.kv_blocks == 0:
            return 0
        return max(1, self.kv_tokens // block_size)

    def cpu_blocks_at(self, block_size: int) -> int:
        if self.cpu.blocks == 0:
            return 0
        return max(1, self.cpu.blocks * self.block_size // block_size)

    def per_block_ms_at(self, ms_per_block: float, block_size: int) -> float:
        """A per-profile-block cost (``cpu.load_ms_per_block``, ``pd.transfer_ms_per_block``) per
        block of ``block_size`` tokens: the cost is per token moved, as ``blocks_at`` converts."""
        return ms_per_block * block_size / self.block_size

    def prefill_ms(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One step prefilling one chunk alone (the oracle tests' formula), the chunk of a
        request just admitted with ``cached_tokens`` prefix hits."""
        p = self.prefill
        n = new_tokens
        return (p.base_ms + p.per_token_ms * n + p.per_token2_ms * n * n + p.per_token_ctx_ms * n * cached_tokens
                + p.per_hit_token_ms * cached_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_SECTIONS = {"prefill": PrefillTiming, "decode": DecodeTiming, "cpu": CpuTier, "pd": PdTransfer,
             "shared_prefill": PrefillTiming, "shared_decode": DecodeTiming}
_INT_KEYS = {"block_size", "kv_blocks", "max_num_seqs", "max_batched_tokens", "blocks", "shared_workers"}

BUILTIN: dict[str, Profile] = {
    # Llama-3-8B-class on one H200 (bf16): an ESTIMATE from first principles until `mesh
    # calibrate` measures it. Prefill ~30k tok/s (16 GFLOP/token at ~50% of ~990 TFLOPS);
    # attention ~1e-6 ms per (new token x context token); decode memory-bound: 16 GB of weights
    # at 4.8 TB/s ~3.3 ms/step, 128 KiB of KV per context token (GQA 8x128, 32 layers);
    # ~110 GB free for KV = ~840k tokens; CPU reload over PCIe ~50 GB/s.
    "h200-8b": Profile(
        name="h200-8b",
        description="Llama-3-8B-class model on one H200 (estimate, not calibrated)",
        estimate=True,
        block_size=16,
        kv_blocks=52_000,
        max_num_seqs=256,
        max_batched_tokens=8192,
        event_lag_ms=0.0,
        prefill=PrefillTiming(base_ms=4.0, per_token_ms=0.033, per_token2_ms=5e-7, per_token_ctx_ms=1e-6),
        decode=DecodeTiming(base_ms=3.5, per_seq_ms=0.02, per_ctx_token_ms=2.7e-5),
        cpu=CpuTier(blocks=0, load_ms_per_block=0.042),
        pd=PdTransfer(transfer_base_ms=1.0, transfer_ms_per_block=0.01),
    ),
    # Dynamo's offline mocker defaults (ai-dynamo-runtime 1.6: vLLM scheduler, 16384 blocks of
    # 64 tokens, 8192-token budget, 256 sequences, polynomial timing: prefill in the step's new
    # tokens 4.209989e-07*t^2 + 1.518344e-02*t + 16.50142 ms; decode in the active KV fraction
    # u = C / capacity: -25.74*u^2 + 54.01*u + 5.74 ms). Used by bench/simulate.py so that both
    # simulators model the same hardware.
    "dynamo-mocker": Profile(
        name="dynamo-mocker",
        description="Dynamo mocker's default timing model and capacity (for side-by-side replays)",
        estimate=True,
        block_size=64,
        kv_blocks=16_384,
        max_num_seqs=256,
        max_batched_tokens=8192,
        prefill=PrefillTiming(base_ms=16.50142, per_token_ms=1.518344e-02, per_token2_ms=4.209989e-07),
        decode=DecodeTiming(
            base_ms=5.74,
            per_ctx_token_ms=54.01 / (16_384 * 64),
            per_ctx_token2_ms=-25.74 / (16_384 * 64) ** 2,
        ),
    ),
    # Timing-free capacity-free profile for reuse studies: every step takes 1 ms.
    "unit": Profile(
        name="unit",
        description="1 ms per step, unbounded KV: for prefix-reuse studies and tests",
        estimate=True,
        block_size=16,
        kv_blocks=0,
        prefill=PrefillTiming(base_ms=1.0),
        decode=DecodeTiming(base_ms=1.0),
    ),
}

DEFAULT_PROFILE = "h200-8b"


def load_profile(spec: str | Path | None, **overrides: Any) -> Profile:
    """A built-in profile by name, or a YAML/JSON file (keys override ``base`` or h200-8b)."""
    if spec is None:
        spec = DEFAULT_PROFILE
    text = str(spec)
    if text in BUILTIN and not Path(text).is_file():
        profile = BUILTIN[text]
    else:
        profile = _from_file(Path(text))
    return with_overrides(profile, **overrides) if overrides else profile


def with_overrides(profile: Profile, **overrides: Any) -> Profile:
    """A copy with top-level keys or ``section.key`` (dotted) keys replaced; None values skipped."""
    data = profile.to_dict()
    for key, value in overrides.items():
        if value is None:
            continue
        section, _, sub = key.partition(".")
        if sub:
            data.setdefault(section, {})[sub] = value
        else:
            data[key] = value
    return from_dict(data, source="overrides")


def from_dict(data: dict[str, Any], *, source: str = "profile") -> Profile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a profile must be a mapping, got {type(data).__name__}")
    base_name = data.get("base", DEFAULT_PROFILE)
    if base_name not in BUILTIN:
        raise ProfileError(f"{source}: unknown base profile {base_name!r} (built-in: {', '.join(BUILTIN)})")
    base = BUILTIN[base_name]
    top: dict[str, Any] = {}
    known = {f.name for f in fields(Profile)}
    for key, value in data.items():
        if key == "base":
            continue
        if key not in known:
            raise ProfileError(f"{source}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        if key in _SECTIONS:
            top[key] = _section(source, key, value, getattr(base, key))
        else:
            top[key] = _scalar(source, key, value, getattr(base, key))
    profile = replace(base, **top)
    _validate(source, profile)
    return profile


def _section(source: str, name: str, value: Any, base: Any) -> Any:
    if not isinstance(value, dict):
        raise ProfileError(f"{source}: {name} must be a mapping, got {value!r}")
    known = {f.name for f in fields(_SECTIONS[name])}
    out = {}
    for key, v in value.items():
        if key not in known:
            raise ProfileError(f"{source}: unknown key {name}.{key} (known: {', '.join(sorted(known))})")
        out[key] = _scalar(source, f"{name}.{key}", v, getattr(base, key))
    return replace(base, **out)


def _scalar(source: str, key: str, value: Any, default: Any) -> Any:
    leaf = key.rpartition(".")[2]
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ProfileError(f"{source}: {key} must be true or false, got {value!r}")
        return value
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ProfileError(f"{source}: {key} must be a string, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{source}: {key} must be a finite number, got {value!r}")
    if leaf in _INT_KEYS:
        if int(value) != value or value < 0:
            raise ProfileError(f"{source}: {key} must be a non-negative integer, got {value!r}")
        return int(value)
    return float(value)


def _validate(source: str, p: Profile) -> None:
    if p.block_size < 1:
        raise ProfileError(f"{source}: block_size must be >= 1")
    if p.max_num_seqs < 1 or p.max_batched_tokens < 1:
        raise ProfileError(f"{source}: max_num_seqs and max_batched_tokens must be >= 1")
    for key in ("event_lag_ms",):
        if getattr(p, key) < 0:
            raise ProfileError(f"{source}: {key} must be >= 0")
    _validate_timing(source, "", p.prefill, p.decode)
    if p.shared_workers == 1:
        raise ProfileError(f"{source}: shared_workers must be 0 (not measured) or >= 2, got 1")
    if p.shared_workers:
        _validate_timing(source, "shared_", p.shared_prefill, p.shared_decode)
    if p.cpu.load_ms_per_block < 0 or p.pd.transfer_ms_per_block < 0 or p.pd.transfer_base_ms < 0:
        raise ProfileError(f"{source}: transfer costs must be >= 0")


def _validate_timing(source: str, prefix: str, prefill: PrefillTiming, decode: DecodeTiming) -> None:
    if prefill.base_ms + prefill.per_token_ms <= 0 and prefill.per_token2_ms <= 0:
        raise ProfileError(f"{source}: {prefix}prefill timing is all zero: simulated time would not advance")
    if decode.base_ms + decode.per_seq_ms <= 0:
        raise ProfileError(f"{source}: {prefix}decode.base_ms + {prefix}decode.per_seq_ms must be > 0")


def with_shared(alone: Profile, shared: list[Profile]) -> Profile:
    """``alone``'s profile with the shared-device timings of ``shared``: the profiles measured on
    every worker of one device at once (their mean, coefficient by coefficient)."""
    if len(shared) < 2:
        raise ProfileError(f"shared timings need the profiles of >= 2 workers measured at once, got {len(shared)}")

    def mean(sections: list[Any]) -> Any:
        cls = type(sections[0])
        return cls(**{f.name: sum(getattr(s, f.name) for s in sections) / len(sections) for f in fields(cls)})

    return replace(alone, shared_workers=len(shared), shared_prefill=mean([p.prefill for p in shared]),
                   shared_decode=mean([p.decode for p in shared]))


MAX_PROFILE_BYTES = 16 << 20


def _from_file(path: Path) -> Profile:
    if not path.exists():
        known = ", ".join(BUILTIN)
        raise ProfileError(f"{path}: no such profile file (built-in profiles: {known})")
    try:
        text = read_regular_file(path, MAX_PROFILE_BYTES).decode("utf-8")
    except (FileProblem, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: {exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError, RecursionError) as exc:
        raise ProfileError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from None
    if data is None:
        raise ProfileError(f"{path}: empty profile")
    if isinstance(data, dict) and isinstance(data.get("profile"), dict):
        data = data["profile"]
    return from_dict(data, source=str(path))


def dump_profile(profile: Profile, path: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Write a profile as YAML (``extra`` keys, e.g. calibration data, go under ``calibration``)."""
    data: dict[str, Any] = {"profile": profile.to_dict()}
    if extra:
        data["calibration"] = extra
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
