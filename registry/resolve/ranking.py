"""Ranking, a pure function of a release view, the hardware catalog and the query.

For each pool and each artifact built for its hardware, `placement.fit.plan_replica` sizes a
replica (tensor-parallel degree, memory per device) and bounds its decode speed, time to first
token and cost per million tokens; a measured performance record of that artifact on that SKU at
the same TP, concurrency and at least the context replaces the estimate. The policy then ranks:
`latency` the fastest per sequence, `cost` the cheapest per token, `quality` the lowest KL, each
among candidates that fit, have room in their pool and meet the caller's SLO.

`rank_release` ranks and says what resolve would answer instead when nothing can be served (the page
that shows a release's fit shows the candidates with that); `rank_candidates` is resolve's: the ranked
candidates, or that answer raised.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kiln.core.error_codes import Codes
from kiln.core.errors import NotFound
from kiln.core.hardware import HardwareCatalog, HardwareProfile
from kiln.core.performance import ITL_MS, TOKENS_PER_S, TTFT_MS
from kiln.core.resolve import MeasurementOut
from kiln.core.shape import ShapeRecord
from kiln.placement.fit import ReplicaPlan, kv_dtype_of, plan_replica
from kiln.registry.resolve.query import Policy, Pool, ResolveQuery
from kiln.registry.resolve.views import ArtifactView, ReleaseView

GIB = 1024**3


@dataclass(frozen=True)
class Speed:
    """The speed a candidate is ranked by: measured where a record applies, else the plan's bounds."""

    source: Literal["measured", "estimate"]
    tokens_per_s: float  # whole replica
    tokens_per_s_per_sequence: float
    ttft_ms: float | None
    cost_per_mtok: float | None
    measurement: MeasurementOut | None
    note: str


@dataclass(frozen=True)
class Candidate:
    artifact: ArtifactView
    pool: Pool
    pool_index: int
    plan: ReplicaPlan
    speed: Speed
    fits: bool  # the replica fits in memory and in the pool's free devices
    meets_slo: bool
    slo_misses: tuple[str, ...]
    explanation: str

    @property
    def hardware(self) -> str:
        return self.pool.hardware


def _human(n: int | float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def runs_on(artifact: ArtifactView, profile: HardwareProfile, catalog: HardwareCatalog) -> tuple[bool, str]:
    """Whether the artifact runs on `profile`, and why not. An SKU the artifact was built before (not in
    its hardware, nor its unsupported list) runs it when a listed SKU has the same architecture."""
    if profile.name in artifact.identity.hardware:
        return True, ""
    if profile.name in artifact.unsupported:
        return False, artifact.unsupported[profile.name]
    twin = catalog.twin(profile, artifact.identity.hardware)
    if twin is not None:
        return True, f"as {twin} (same architecture, {profile.arch})"
    return False, "not built for it"


def _measurement(artifact: ArtifactView, plan: ReplicaPlan) -> MeasurementOut | None:
    """The record that speaks for this replica: same SKU, TP and concurrency, at the requested context or
    longer (the nearest, then the newest)."""
    matching = [
        m
        for m in artifact.measurements
        if m.hardware == plan.hardware
        and m.tp == plan.tp
        and m.concurrency == plan.concurrency
        and m.context >= plan.context
        and _in_bounds(m)
    ]
    return min(matching, key=lambda m: (m.context, -m.id)) if matching else None


def _in_bounds(m: MeasurementOut) -> bool:
    """A record inside the ranges PerformanceCreate accepts: resolve divides by its speeds. (Records stored
    by an older kiln, which took any positive number, are not used.)"""
    return (
        TOKENS_PER_S[0] <= m.tokens_per_s <= TOKENS_PER_S[1]
        and TTFT_MS[0] <= m.ttft_ms <= TTFT_MS[1]
        and ITL_MS[0] <= m.itl_p50_ms <= ITL_MS[1]
    )


def _speed(artifact: ArtifactView, plan: ReplicaPlan, profile: HardwareProfile) -> Speed:
    m = _measurement(artifact, plan)
    if m is None:
        others = [x for x in artifact.measurements if x.hardware == plan.hardware]
        note = "estimated (bounds from the catalog)"
        if others:
            at = ", ".join(f"TP {x.tp}, {x.context} × {x.concurrency}" for x in others[:3])
            note += f"; measured on {plan.hardware} only at {at}"
        return Speed(
            "estimate",
            plan.decode_tokens_per_s,
            plan.decode_tokens_per_s_per_sequence,
            plan.ttft_s * 1000 if plan.ttft_s is not None else None,
            plan.cost_per_mtok,
            None,
            note,
        )
    price = profile.price_per_device_hour
    cost = price * plan.tp / (m.tokens_per_s * 3600) * 1e6 if price is not None else None
    note = (
        f"measured by {m.runtime_version} on {m.hardware} (TP {m.tp}, context {m.context} × {m.concurrency}): "
        f"{m.tokens_per_s:g} tokens/s, TTFT {m.ttft_ms:g} ms, ITL p50 {m.itl_p50_ms:g} ms / p99 {m.itl_p99_ms:g} ms"
    )
    return Speed("measured", m.tokens_per_s, 1000 / m.itl_p50_ms, m.ttft_ms, cost, m, note)


def _slo_misses(speed: Speed, query: ResolveQuery) -> tuple[str, ...]:
    misses = []
    if query.min_tokens_per_s is not None and speed.tokens_per_s_per_sequence < query.min_tokens_per_s:
        misses.append(f"{speed.tokens_per_s_per_sequence:.1f} < {query.min_tokens_per_s:g} tokens/s per sequence")
    if query.max_ttft_ms is not None:
        if speed.ttft_ms is None:
            misses.append("TTFT unknown (the model_config lacks its parameter count)")
        elif speed.ttft_ms > query.max_ttft_ms:
            misses.append(f"TTFT {speed.ttft_ms:.0f} > {query.max_ttft_ms:g} ms")
    return tuple(misses)


def _candidate(
    artifact: ArtifactView,
    pool: Pool,
    index: int,
    profile: HardwareProfile,
    shape: ShapeRecord | str,
    query: ResolveQuery,
    how: str,
) -> Candidate:
    plan = plan_replica(
        profile,
        shape,
        artifact.total_size,
        artifact.identity.quant,
        query.context,
        query.concurrency,
        kv_dtype_of(artifact.identity.quant, query.kv_dtype, profile),
        max_devices=pool.free_devices or None,
    )
    speed = _speed(artifact, plan, profile)
    room = pool.free_devices is None or plan.tp <= pool.free_devices
    fits = plan.fits and room
    misses = _slo_misses(speed, query)
    cost = f"${speed.cost_per_mtok:.3g}/Mtok" if speed.cost_per_mtok is not None else "no price"
    ttft = f"TTFT {speed.ttft_ms:.0f} ms" if speed.ttft_ms is not None else "TTFT unknown"
    parts = [
        f"{artifact.identity.name} on {pool.hardware}{f' {how}' if how else ''}: {plan.explanation}",
        f"{speed.tokens_per_s:.1f} tokens/s per replica, {speed.tokens_per_s_per_sequence:.1f} per sequence, "
        f"{ttft}, {cost} ({speed.note})",
        f"eval {artifact.eval_status}" + (f", kl {artifact.kl:g}" if artifact.kl is not None else ""),
    ]
    if not room:
        parts.append(f"the pool has {pool.free_devices} free devices, the replica needs {plan.tp}")
    if misses:
        parts.append("misses the SLO: " + "; ".join(misses))
    return Candidate(artifact, pool, index, plan, speed, fits, not misses, misses, "; ".join(parts))


# The policies' criteria after fit, SLO and eval status, each a value where lower ranks first.
CRITERIA: dict[str, Callable[[Candidate], float]] = {
    "speed": lambda c: -c.speed.tokens_per_s_per_sequence,
    "kl": lambda c: c.artifact.kl if c.artifact.kl is not None else math.inf,
    "cost": lambda c: c.speed.cost_per_mtok if c.speed.cost_per_mtok is not None else math.inf,
}
POLICY_ORDER: dict[Policy, tuple[str, ...]] = {
    "latency": ("speed", "kl", "cost"),
    "cost": ("cost", "speed", "kl"),
    "quality": ("kl", "speed", "cost"),
}


def rank_criteria(policy: Policy) -> tuple[str, ...]:
    """The names of `rank_key`'s values, in its order: what a candidate is compared on, first to last."""
    return ("fits", "slo", "eval", *POLICY_ORDER[policy], "pool", "name")


def rank_key(c: Candidate, policy: Policy) -> tuple[object, ...]:
    """The candidate's sort key under `policy` (smaller first), one value per `rank_criteria` name."""
    return (
        not c.fits,
        not c.meets_slo,
        0 if c.artifact.eval_status == "passed" else 1,
        *(CRITERIA[name](c) for name in POLICY_ORDER[policy]),
        c.pool_index,
        c.artifact.identity.name,
    )


@dataclass(frozen=True)
class Unranked:
    """An artifact resolve did not rank on a pool: not built for its SKU, or its eval failed (`reason` says)."""

    artifact: ArtifactView
    hardware: str
    reason: str
    eval_failed: bool


@dataclass(frozen=True)
class Ranking:
    """Every (artifact, pool) candidate, best first, the artifacts left out and why, and `problem`: the
    NO_COMPATIBLE_ARTIFACT or SLO_UNMET error resolve answers when the first cannot be served (None when it can)."""

    ranked: tuple[Candidate, ...]
    unranked: tuple[Unranked, ...]
    problem: NotFound | None


def rank_candidates(view: ReleaseView, catalog: HardwareCatalog, query: ResolveQuery, channel: str) -> list[Candidate]:
    """Every (artifact, pool) candidate, best first by the query's policy; the first fits and meets the SLO.

    NO_COMPATIBLE_ARTIFACT says why nothing runs or fits; SLO_UNMET what the best achieves."""
    ranking = rank_release(view, catalog, query, f"{view.model}@{view.version} (channel {channel})")
    if ranking.problem is not None:
        raise ranking.problem
    return list(ranking.ranked)


def rank_release(view: ReleaseView, catalog: HardwareCatalog, query: ResolveQuery, where: str) -> Ranking:
    """Every (artifact, pool) candidate of `view`, best first by the query's policy, the artifacts left out and
    why, and the error resolve would answer instead of the first (`where` names the release in it)."""
    profiles = [catalog.get(p.hardware) for p in query.pools]
    names = [p.name for p in profiles]
    details: dict[str, Any] = {"model": view.model, "version": view.version, "hardware": names}
    candidates: list[Candidate] = []
    unranked: list[Unranked] = []
    why: dict[str, list[str]] = {}  # reason -> "artifact (hardware)"
    failed: list[str] = []
    for index, (pool, profile) in enumerate(zip(query.pools, profiles, strict=True)):
        for a in view.artifacts:
            runs, how = runs_on(a, profile, catalog)
            if not runs:
                why.setdefault(how, []).append(
                    f"{a.identity.name} ({profile.name})" if len(profiles) > 1 else a.identity.name
                )
                unranked.append(Unranked(a, profile.name, how, eval_failed=False))
            elif a.eval_status == "failed":
                failed.append(f"{a.identity.name} on {profile.name} ({', '.join(a.failed_reasons)})")
                unranked.append(Unranked(a, profile.name, "; ".join(a.failed_reasons), eval_failed=True))
            else:
                candidates.append(_candidate(a, pool, index, profile, view.shape, query, how))
    if not candidates:
        if failed:
            problem = NotFound(
                f"every artifact of {where} for {', '.join(names)} failed its eval: {'; '.join(failed)}",
                code=Codes.NO_COMPATIBLE_ARTIFACT,
                details={**details, "failed": failed},
            )
            return Ranking((), tuple(unranked), problem)
        supported = sorted({h for a in view.artifacts for h in a.identity.hardware})
        reasons = "; ".join(f"{reason} ({', '.join(items)})" for reason, items in why.items())
        what = f"{reasons}. Its artifacts run on: {', '.join(supported)}" if supported else "it has no artifacts"
        problem = NotFound(
            f"release {where} has no artifact for hardware {', '.join(map(repr, names))}: {what}",
            code=Codes.NO_COMPATIBLE_ARTIFACT,
            details={**details, "supported_hardware": supported, "reasons": why},
        )
        return Ranking((), tuple(unranked), problem)
    ranked = tuple(sorted(candidates, key=lambda c: rank_key(c, query.policy)))
    return Ranking(ranked, tuple(unranked), _problem(ranked, where, names, details, query))


def _problem(
    ranked: tuple[Candidate, ...], where: str, names: list[str], details: dict[str, Any], query: ResolveQuery
) -> NotFound | None:
    """Why the first of `ranked` cannot be served (it does not fit, or misses the SLO); None when it can."""
    best = ranked[0]
    if not best.fits:
        needs = "; ".join(
            f"{c.artifact.identity.name} on {c.hardware} needs TP {c.plan.tp} × "
            f"{_human(c.plan.required_per_device_bytes)} "
            f"(weights {_human(c.plan.weights_per_device_bytes)} + KV cache {_human(c.plan.kv_per_device_bytes)}"
            f" per device) of {_human(c.plan.usable_per_device_bytes)} usable"
            + (f", {c.pool.free_devices} free" if c.pool.free_devices is not None else "")
            for c in ranked
        )
        return NotFound(
            f"no artifact of {where} fits on {', '.join(names)} with context {query.context} × concurrency "
            f"{query.concurrency}: {needs}",
            code=Codes.NO_COMPATIBLE_ARTIFACT,
            details={
                **details,
                "memory_bytes": best.plan.memory_per_device_bytes,
                "candidates": [
                    {
                        "artifact": c.artifact.identity.name,
                        "hardware": c.hardware,
                        "tp": c.plan.tp,
                        "required_bytes": c.plan.required_per_device_bytes,
                    }
                    for c in ranked
                ],
            },
        )
    if not best.meets_slo:
        return NotFound(
            f"no artifact of {where} on {', '.join(names)} meets the SLO; the best, {best.artifact.identity.name} on "
            f"{best.hardware}: {'; '.join(best.slo_misses)}",
            code=Codes.SLO_UNMET,
            details={
                **details,
                "best": {
                    "artifact": best.artifact.identity.name,
                    "hardware": best.hardware,
                    "tokens_per_s_per_sequence": best.speed.tokens_per_s_per_sequence,
                    "ttft_ms": best.speed.ttft_ms,
                },
            },
        )
    return None
