"""The plugin pipeline (llm-d's split): filters -> weighted scorers -> picker.

- A **filter** drops candidates (unhealthy, wrong model, no headroom).
- A **scorer** gives every remaining candidate a score in [0, 1]; the pipeline multiplies it by
  the scorer's weight (configured outside the scorer) and sums the terms into a total.
- A **picker** chooses one candidate from the totals (ties broken fairly, never "the first").

Profiles run the pipeline once for prefill and once for decode: with ``profiles: {prefill: ...,
decode: ...}`` the decision names a prefill target and a ``decode_target``.

Invariants: no I/O, no clock (``cluster.now``), randomness only from ``cluster.rng`` (handed to the picker).
Every plugin is built through ``policies.registry.create`` so that built-in names, ``module:Class``
paths and ``mesh.policies`` entry points all work, and every error is a ``PluginError``.
"""

from __future__ import annotations

import abc
import logging
import operator
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.base import ClusterView, Decision, NoCandidate, Overlap, Policy, RequestInfo, Role, TargetState
from policies.params import number
from policies.registry import PluginError, create, register

log = logging.getLogger("policies.pipeline")


class Filter(abc.ABC):
    """Removes candidates that must not take the request. Returns the kept ones, in order."""

    name: str = "filter"

    @abc.abstractmethod
    def filter(
        self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]
    ) -> list[TargetState]: ...

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


class Scorer(abc.ABC):
    """Scores every candidate in [0, 1] (higher is better); returns one float per candidate.

    Built-in scorers set ``trusted = True``: they guarantee the range, so the pipeline skips the
    clamp it applies to a plugin's scores (a plugin bug must not poison the total).
    """

    name: str = "scorer"
    trusted: bool = False

    @abc.abstractmethod
    def score(
        self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]
    ) -> Sequence[float]: ...

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


class Picker(abc.ABC):
    """Chooses one candidate: returns its index.

    ``totals`` holds each candidate's weighted score; ``columns`` holds each scorer's raw scores
    (in the configured scorer order) for pickers that rank by terms instead of the sum; ``rng``
    is the decision's (``ClusterView.rng``), the only source of randomness a picker may use.
    """

    name: str = "picker"

    @abc.abstractmethod
    def pick(self, totals: Sequence[float], columns: Sequence[Sequence[float]], rng: random.Random) -> int: ...

    def summary(self, terms: Sequence[str]) -> str:
        """How the choice was made, for ``Decision.reason``; ``terms`` are the scorer names."""
        return f"picked by {self.name}"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


DEFAULT_FILTERS: tuple[str, ...] = ("healthy", "model_match")
_SCORER_KEYS = frozenset({"name", "weight", "params"})
_PROFILE_KEYS = frozenset({"filters", "scorers", "picker"})


def validate_weight(owner: str, weight: Any) -> float:
    """A scorer weight: a real number, finite and >= 0."""
    return number(owner, "weight", weight, 0.0)


def _check_kind(kind: str, obj: Any, base: type, method: str) -> None:
    if not callable(getattr(obj, method, None)):
        raise PluginError(
            f"{kind} {getattr(obj, 'name', type(obj).__name__)!r} has no {method}() method "
            f"(subclass policies.pipeline.{base.__name__})"
        )


def build_filter(spec: Any) -> Filter:
    obj: Filter = create("filter", spec)
    _check_kind("filter", obj, Filter, "filter")
    return obj


def build_scorer(spec: Any, index: int) -> tuple[Scorer, float]:
    """A scorer entry: a bare name (weight 1) or ``{name, weight, params}``."""
    where = f"scorers[{index}]"
    if isinstance(spec, dict):
        unknown = set(spec) - _SCORER_KEYS
        if unknown:
            raise PluginError(f"{where}: unknown keys {sorted(unknown)} (allowed: name, weight, params)")
        weight = validate_weight(f"{where} ({spec.get('name')!r})", spec.get("weight", 1.0))
        spec = {k: v for k, v in spec.items() if k != "weight"}
    elif isinstance(spec, str):
        weight = 1.0
    else:
        raise PluginError(f"{where}: expected a name or a map with name/weight/params, got {spec!r}")
    obj = create("scorer", spec)
    _check_kind("scorer", obj, Scorer, "score")
    return obj, weight


def build_picker(spec: Any) -> Picker:
    obj: Picker = create("picker", spec)
    _check_kind("picker", obj, Picker, "pick")
    return obj


def _as_list(owner: str, value: Any) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise PluginError(f"{owner} must be a list, got {type(value).__name__}")
    return value


def _checked(scorer: Scorer, request: RequestInfo, cluster: ClusterView, found: list[TargetState]) -> list[float]:
    """A plugin scorer's output, checked for shape and forced into [0, 1] (NaN counts as 0)."""
    try:
        raw = scorer.score(request, cluster, found)
    except NoCandidate:
        raise
    except Exception as exc:  # named as raising, not as returning non-numbers
        raise PluginError(f"scorer {scorer.name!r} raised {type(exc).__name__}: {exc}") from exc
    try:
        col = [float(v) for v in raw]
    except (TypeError, ValueError) as exc:
        raise PluginError(f"scorer {scorer.name!r} returned something other than numbers: {exc}") from exc
    if len(col) != len(found):
        raise PluginError(f"scorer {scorer.name!r} returned {len(col)} scores for {len(found)} candidates")
    return [0.0 if not v == v else (0.0 if v < 0.0 else (1.0 if v > 1.0 else v)) for v in col]


def _checked_pick(picker: Picker, pick: Any, n: int) -> int:
    """A picker's answer as an index into ``n`` candidates (numpy integers accepted), else a ``PluginError``."""
    try:
        index = operator.index(pick) if not isinstance(pick, bool) else -1
    except TypeError:
        index = -1
    if not 0 <= index < n:
        raise PluginError(f"picker {picker.name!r} returned {pick!r} for {n} candidates")
    return index


@dataclass(frozen=True, slots=True)
class ProfileResult:
    target: str
    reason: str
    scores: dict[str, dict[str, float]]


class Profile:
    """One filters -> scorers -> picker run. ``roles`` (when set) is an implicit first filter."""

    def __init__(
        self,
        label: str,
        filters: list[Any] | None,
        scorers: list[Any] | None,
        picker: Any,
        roles: frozenset[Role] | None = None,
        explain_top: int = 16,
    ) -> None:
        self.label = label
        specs = list(DEFAULT_FILTERS) if filters is None else _as_list(f"{label}.filters", filters)
        self.filters = [build_filter(s) for s in specs]
        # Health and model match are never optional (a request sent to a dead worker, or to one
        # that does not serve its model, fails): a configured list without them gets them first.
        for i, required in enumerate(DEFAULT_FILTERS):
            if not any(_builtin(f, required) for f in self.filters):
                self.filters.insert(i, build_filter(required))
        self.scorers: list[tuple[Scorer, float]] = [
            build_scorer(s, i) for i, s in enumerate(_as_list(f"{label}.scorers", scorers))
        ]
        self.terms = _term_names([s.name for s, _ in self.scorers])
        self._scorer_objs = [s for s, _ in self.scorers]
        self._totals, self._rows, self._rows_at = _compile_combiners(
            [w for _, w in self.scorers], (*self.terms, "total")
        )
        if isinstance(explain_top, bool) or not isinstance(explain_top, int) or explain_top < 1:
            raise PluginError(f"{label}: explain_top must be an integer >= 1, got {explain_top!r}")
        self.explain_top = explain_top
        # The built-in healthy and model_match filters run fused in _first_pass; plugins after.
        fused = {"healthy", "model_match"}
        self._rest = [f for f in self.filters if not (f.name in fused and _builtin(f, f.name))]
        self._first_names = "/".join(f.name for f in self.filters if f not in self._rest)
        self.picker = build_picker(picker if picker is not None else "max_score")
        self.reason = self.picker.summary(self.terms)
        self.roles = roles

    def run(self, request: RequestInfo, cluster: ClusterView) -> ProfileResult:
        found = self._first_pass(request, cluster)
        if not found:
            raise NoCandidate(f"{self.label}: no candidate left after filter {self._first_names}")
        for f in self._rest:
            found = f.filter(request, cluster, found)
            if not found:
                raise NoCandidate(f"{self.label}: no candidate left after filter {f.name!r}")
        columns = [
            s.score(request, cluster, found) if s.trusted else _checked(s, request, cluster, found)
            for s in self._scorer_objs
        ]
        n = len(found)
        totals = self._totals(n, *columns)
        pick = self.picker.pick(totals, columns, cluster.rng) if n > 1 else 0
        if type(pick) is not int or not 0 <= pick < n:  # a plugin picker's bad index: name it, not IndexError
            pick = _checked_pick(self.picker, pick, n)
        ids = [t.id for t in found]
        if not cluster.explain:  # the request path: the pick's terms only
            rows = self._rows_at([pick], ids, *columns, totals)
        elif n <= self.explain_top:
            rows = self._rows(ids, *columns, totals)
        else:
            rows = self._rows_at(_top(totals, pick, self.explain_top), ids, *columns, totals)
        return ProfileResult(ids[pick], self.reason, rows)

    def _first_pass(self, request: RequestInfo, cluster: ClusterView) -> list[TargetState]:
        """Health, the profile's roles and model/LoRA match, the always-applied filters: pure
        per-target predicates, so the order among them does not matter."""
        roles, model, lora = self.roles, request.model, request.lora
        return [
            t for t in cluster.targets
            if t.healthy and not t.draining and not t.circuit_open
            and (not t.models or model in t.models)
            and (roles is None or t.role in roles)
            and (not lora or not t.loras or lora in t.loras)
        ]

    def describe(self) -> dict[str, Any]:
        return {
            "filters": [f.name for f in self.filters],
            "scorers": [{"name": s.name, "weight": w} for s, w in self.scorers],
            "picker": self.picker.name,
        }


def _compile_combiners(weights: list[float], keys: tuple[str, ...]) -> tuple[Any, Any, Any]:
    """Three functions specialised to this profile's scorer count (the decision hot path):
    ``totals(n, c0, c1, ..)`` -> weighted sums; ``rows(ids, c0, c1, .., totals)`` ->
    ``{target: {term: score, .., "total": sum}}``; ``rows_at(keep, ids, c0, .., totals)``, the same
    for the indices in ``keep``. A generated dict display is ~3x faster than ``dict(zip(..))``
    per row. Only column *counts* reach the source text; weights and keys are bound as values,
    so nothing from the config is ever executed.
    """
    k = len(weights)
    cs = "".join(f", c{i}" for i in range(k))
    xs = "".join(f"x{i}, " for i in range(k))
    env: dict[str, Any] = {f"w{i}": w for i, w in enumerate(weights)}
    env.update({f"k{i}": key for i, key in enumerate(keys)})
    # a weight of 1 multiplies by nothing (1.0 * x == x exactly): one multiply less per row
    total = " + ".join(f"x{i}" if weights[i] == 1.0 else f"w{i} * x{i}" for i in range(k) if weights[i]) or "0.0"
    row = "".join(f"k{i}: x{i}, " for i in range(k)) + f"k{k}: s"
    row_at = "".join(f"k{i}: c{i}[j], " for i in range(k)) + f"k{k}: tot[j]"
    totals = f"[{total} for {xs}in zip({cs[2:]})]" if k else "[0.0] * n"
    src = (
        f"def totals(n{cs}):\n    return {totals}\n"
        f"def rows(ids{cs}, tot):\n    return {{t: {{{row}}} for t, {xs}s in zip(ids{cs}, tot)}}\n"
        f"def rows_at(keep, ids{cs}, tot):\n    return {{ids[j]: {{{row_at}}} for j in keep}}\n"
    )
    exec(compile(src, "<pipeline combiners>", "exec"), env)  # noqa: S102 (source built from counts only)
    return env["totals"], env["rows"], env["rows_at"]


def _top(totals: list[float], pick: int, k: int) -> list[int]:
    """Indices of (at most) the ``k`` best totals, the pick always among them."""
    cut = sorted(totals)[-k]
    keep = [i for i, v in enumerate(totals) if v >= cut][:k]
    if pick not in keep:
        keep[-1] = pick
    return keep


def _builtin(f: Filter, name: str) -> bool:
    return f.name == name and type(f).__module__ == "policies.filters"


def _term_names(names: list[str]) -> tuple[str, ...]:
    """Score keys in ``Decision.scores``: the scorer names, a duplicate gets ``#2``, ``#3``..."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return tuple(out)


@register("policy", "pipeline")
class Pipeline(Policy):
    """filters -> weighted scorers -> picker; or two profiles (prefill, decode) for P/D pairs.

    Params: ``filters`` (``healthy`` and ``model_match`` are always applied, listed or not),
    ``scorers`` (``[{name, weight, params}]``, weights finite and >= 0), ``picker`` (default
    ``max_score``); or ``profiles: {prefill: {...}, decode: {...}}`` with the same three keys
    each. ``explain_top`` (default 16) bounds the candidates whose per-term scores the decision
    carries (the best ones and the pick): building them is a cost every request pays. A prefill profile considers prefill-role targets, a decode profile decode-role ones;
    when no pair can be formed the prefill profile runs over mixed-role targets instead.

    ``local_prefill_tokens`` (profiles only; default 0 = always a pair): conditional
    disaggregation. When the chosen decode target would have to prefill at most this many
    uncached prompt tokens itself, the decision names that decode target alone (no pair): a
    short or mostly cached prompt costs the decode worker less than a relay, a remote prefill
    and a KV hand-off cost the request (Dynamo's and SGLang's routers have the same knob).
    """

    def __init__(
        self,
        filters: list[Any] | None = None,
        scorers: list[Any] | None = None,
        picker: Any = None,
        profiles: Mapping[str, Any] | None = None,
        explain_top: int = 16,
        local_prefill_tokens: int = 0,
    ) -> None:
        if isinstance(local_prefill_tokens, bool) or not isinstance(local_prefill_tokens, int) or local_prefill_tokens < 0:
            raise PluginError(f"pipeline: local_prefill_tokens must be an integer >= 0, got {local_prefill_tokens!r}")
        if local_prefill_tokens and profiles is None:
            raise PluginError("pipeline: local_prefill_tokens needs prefill/decode profiles")
        self.local_prefill_tokens = local_prefill_tokens
        self.profile: Profile | None = None
        self.pd: tuple[Profile, Profile, Profile] | None = None  # prefill, decode, mixed fallback
        if profiles is None:
            self.profile = Profile("pipeline", filters, scorers, picker, explain_top=explain_top)
            _warn_unscored([self.profile])
            return
        if filters is not None or scorers is not None or picker is not None:
            raise PluginError("pipeline: give either profiles or filters/scorers/picker, not both")
        self.pd = _build_profiles(profiles, explain_top)
        _warn_unscored(self.pd[:2])  # the mixed fallback is the prefill profile again

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        ov = cluster.overlaps(request)
        overlaps: dict[str, Overlap] = ov if type(ov) is dict else dict(ov)
        if self.pd is None:
            res = self.profile.run(request, cluster)  # type: ignore[union-attr]
            return Decision(res.target, res.reason, res.scores, overlaps)
        prefill, decode, mixed = self.pd
        try:
            pre = prefill.run(request, cluster)
            dec = decode.run(request, cluster)
        except NoCandidate as exc:
            try:
                res = mixed.run(request, cluster)
            except NoCandidate:
                raise NoCandidate(f"no prefill/decode pair ({exc}) and no mixed-role candidate") from exc
            return Decision(res.target, f"{res.reason} (mixed-role fallback: {exc})", res.scores, overlaps)
        scores = {**dec.scores, **pre.scores}  # role sets are disjoint: no target is in both
        uncached = _uncached_tokens(request, overlaps.get(dec.target)) if self.local_prefill_tokens else -1
        if 0 <= uncached <= self.local_prefill_tokens:
            reason = f"decode {dec.reason}; prefills locally ({uncached} uncached tokens <= {self.local_prefill_tokens})"
            return Decision(dec.target, reason, scores, overlaps)
        reason = f"prefill {pre.reason}; decode {dec.reason}"
        return Decision(pre.target, reason, scores, overlaps, dec.target)

    def describe(self) -> dict[str, Any]:
        if self.pd is None:
            return {"name": self.name, **self.profile.describe()}  # type: ignore[union-attr]
        return {"name": self.name, "profiles": {"prefill": self.pd[0].describe(), "decode": self.pd[1].describe()},
                "local_prefill_tokens": self.local_prefill_tokens}


def _warn_unscored(profiles: Sequence[Profile]) -> None:
    """A profile without scorers scores every candidate 0: its picker then chooses at random (a
    policy that routes like ``random``, e.g. a scorer list lost to a YAML slip). Kept valid (a
    fair random choice among filtered targets is a use), but said loudly at load."""
    for p in profiles:
        if not p.scorers:
            log.warning("%s: no scorers: every candidate scores 0, so the %r picker chooses among the filtered "
                        "targets at random (cache and load ignored); list scorers, or use policy 'random' if "
                        "that is meant", "pipeline" if p.label == "pipeline" else f"pipeline profile {p.label!r}",
                        p.picker.name)


def _uncached_tokens(request: RequestInfo, overlap: Overlap | None) -> int:
    """Prompt tokens a target would compute itself (its cached prefix, GPU or CPU tier, is not)."""
    cached = (overlap.gpu_blocks + overlap.cpu_blocks) * request.block_size if overlap is not None else 0
    return max(request.prompt_tokens - cached, 0)


def _build_profiles(profiles: Any, explain_top: int) -> tuple[Profile, Profile, Profile]:
    """Prefill profile over prefill-role targets, decode over decode-role ones, and the prefill
    profile again over mixed-role targets for when no pair can be formed."""
    if not isinstance(profiles, Mapping) or set(profiles) != {"prefill", "decode"}:
        got = sorted(profiles) if isinstance(profiles, Mapping) else profiles
        raise PluginError(f"pipeline: profiles must have exactly 'prefill' and 'decode', got {got!r}")
    for label in ("prefill", "decode"):
        body = profiles[label]
        if not isinstance(body, Mapping):
            raise PluginError(f"pipeline: profile {label!r} must be a map, got {body!r}")
        unknown = set(body) - _PROFILE_KEYS
        if unknown:
            raise PluginError(f"pipeline: profile {label!r} has unknown keys {sorted(unknown)}")
    p, d = profiles["prefill"], profiles["decode"]

    def make(label: str, body: Mapping[str, Any], role: Role) -> Profile:
        return Profile(label, body.get("filters"), body.get("scorers"), body.get("picker"), frozenset({role}), explain_top)

    return make("prefill", p, Role.PREFILL), make("decode", d, Role.DECODE), make("mixed", p, Role.MIXED)
