"""HTTP route for resolve: policies over pools, weighted channel splits with stable keys, ETags and long-poll."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from kiln.core.error_codes import Codes
from kiln.core.errors import InvalidInput
from kiln.core.manifest import FileOut
from kiln.core.performance import MAX_CONCURRENCY, MAX_CONTEXT, TOKENS_PER_S, TTFT_MS
from kiln.core.resolve import ResolveCandidate, ResolvedArtifact, ResolveOut, ResolveReason, SplitMember
from kiln.registry.api.errors import error_responses
from kiln.registry.api.lean_route import LeanRoute
from kiln.registry.api.params import CHANNEL_PATTERN, MODEL_NAME_PATTERN, VERSION_PATTERN
from kiln.registry.api.urls import artifact_file_url, base_url
from kiln.registry.channels.buckets import BASIS_POINTS
from kiln.registry.deps import require
from kiln.registry.resolve.cache import Answer, ChannelSnapshot, ResolveCache, SnapshotKey
from kiln.registry.resolve.explain import explain_choice
from kiln.registry.resolve.query import ResolveQuery
from kiln.registry.resolve.ranking import Candidate, rank_candidates
from kiln.registry.resolve.snapshots import channel_snapshot, load_catalog, load_release_view, snapshot_of
from kiln.registry.settings import RegistrySettings

# Lean: the hot path, answered by the app's LeanLane in front of FastAPI's per-request machinery
# (registry.api.lean_route). The lane runs the router's own dependencies: it declares its READ.
router = APIRouter(prefix="/v1", tags=["resolve"], route_class=LeanRoute, dependencies=[require("read")])

MAX_WAIT_S = 60
POLL_INTERVAL_S = 1.0  # how often a long-poll looks again (one indexed query, or SQLite's data_version)


def _candidate_out(c: Candidate, base: str, model: str, version: str) -> ResolveCandidate:
    a, plan, speed = c.artifact, c.plan, c.speed
    m = speed.measurement
    return ResolveCandidate(
        hardware=c.hardware,
        artifact=ResolvedArtifact.of(
            a.identity,
            manifest_digest=a.manifest_digest,
            files=[
                FileOut(
                    path=f.path,
                    sha256=f.sha256,
                    size=f.size,
                    url=artifact_file_url(base, model, version, a.identity.name, f.path),
                )
                for f in a.files
            ],
        ),
        reason=ResolveReason(
            fits=c.fits,
            tp=plan.tp,
            weights_bytes=plan.weights_bytes,
            kv_cache_bytes=plan.kv_cache_bytes,
            memory_bytes=plan.memory_per_device_bytes,
            usable_bytes=plan.usable_per_device_bytes,
            required_bytes=plan.required_per_device_bytes,
            kv_room_bytes=plan.kv_room_per_device_bytes,
            decode_tokens_per_s_bound=plan.decode_tokens_per_s,
            prefill_tokens_per_s_bound=plan.prefill_tokens_per_s,
            tokens_per_s=speed.tokens_per_s,
            tokens_per_s_per_sequence=speed.tokens_per_s_per_sequence,
            ttft_ms=speed.ttft_ms,
            cost_per_mtok=speed.cost_per_mtok,
            speed_source=speed.source,
            measured=m,
            meets_slo=c.meets_slo,
            eval_status=a.eval_status,
            kl=a.kl,
            basis=plan.basis,
            explanation=c.explanation,
        ),
    )


def _split_out(snapshot: ChannelSnapshot, chosen: str) -> list[SplitMember] | None:
    if not snapshot.is_split:
        return None
    return [
        SplitMember(version=m.version, weight=w * 100 / BASIS_POINTS, chosen=m.version == chosen)
        for m, w in snapshot.members
    ]


def _matches(if_none_match: str | None, etag: str) -> bool:
    if if_none_match is None:
        return False
    tags = [t.strip().removeprefix("W/") for t in if_none_match.split(",")]
    return etag in tags or "*" in tags


@router.get(
    "/resolve",
    summary="The artifact a pool of this hardware should load from a channel, why, and ranked fallbacks",
    response_model=ResolveOut,
    responses={304: {"description": "unchanged since the caller's ETag (If-None-Match)"}, **error_responses(404, 422)},
)
async def resolve(
    request: Request,
    model: Annotated[str, Query(pattern=MODEL_NAME_PATTERN)],
    hardware: Annotated[
        str,
        Query(
            max_length=1000,
            description="hardware pools in order of preference, each optionally with its free devices: "
            "h100 or h100:4,mi300x,tpu-v5e:16",
        ),
    ],
    channel: Annotated[str, Query(pattern=CHANNEL_PATTERN)] = "prod",
    context: Annotated[int, Query(ge=1, le=MAX_CONTEXT, description="tokens of context per sequence")] = 4096,
    concurrency: Annotated[int, Query(ge=1, le=MAX_CONCURRENCY, description="sequences served at once")] = 1,
    policy: Annotated[
        Literal["latency", "cost", "quality"],
        Query(description="latency: fastest per sequence; cost: cheapest per token; quality: lowest KL"),
    ] = "latency",
    kv_cache_dtype: Annotated[Literal["bf16", "fp8"], Query(description="the KV cache's element type")] = "bf16",
    min_tokens_per_s: Annotated[
        float | None,
        Query(
            ge=TOKENS_PER_S[0], le=TOKENS_PER_S[1], allow_inf_nan=False, description="SLO: decode tokens/s per sequence"
        ),
    ] = None,
    max_ttft_ms: Annotated[
        float | None,
        Query(ge=TTFT_MS[0], le=TTFT_MS[1], allow_inf_nan=False, description="SLO: time to first token"),
    ] = None,
    key: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=256,
            description="a request or session id: on a split channel, the same key gets the same release "
            "while the weights are unchanged",
        ),
    ] = None,
    version: Annotated[
        str | None,
        Query(
            pattern=VERSION_PATTERN,
            description="a release of the channel (a member of its split, or the release it points at): "
            "answer for that release (how a router renders each member's placement); not with `key`",
        ),
    ] = None,
    wait: Annotated[
        int,
        Query(
            ge=0,
            le=MAX_WAIT_S,
            description="with If-None-Match: hold the request up to this many seconds "
            "until the answer changes (long-poll); 304 if it does not",
        ),
    ] = 0,
) -> Response:
    # async, and rendered here rather than by FastAPI: no second validation of the answer on the hot
    # path, and no thread hop where the answer is known from memory (SQLite's WAL-index header says
    # nothing was committed since the channel was read, and the answer is cached). Anything that asks
    # the database (the indexed query on the resolve cache's own connection, a session on a miss) runs
    # in the thread pool: the event loop never waits on the database. The query's own values (strings
    # and numbers, cheap to hash) key the answer with the channel's fingerprint and the release the
    # key lands on; the pools are parsed only on a miss.
    if version is not None and key is not None:
        raise InvalidInput(
            "give `key` (the release a caller lands on) or `version` (a release of the channel), not both",
            code=Codes.RESOLVE_KEY_AND_VERSION,
            details={"key": key, "version": version},
        )
    asked = ResolveQuery(hardware, policy, context, concurrency, kv_cache_dtype, min_tokens_per_s, max_ttft_ms)
    # The raw header list, not `request.headers` (built per request): this is the hot path.
    if_none_match = next((v.decode("latin-1") for k, v in request.scope["headers"] if k == b"if-none-match"), None)
    answer = await _answer(request, model, channel, asked, key, version)
    if wait and if_none_match is not None:
        deadline = time.monotonic() + wait
        while _matches(if_none_match, answer.etag) and time.monotonic() < deadline:
            await asyncio.sleep(min(POLL_INTERVAL_S, max(deadline - time.monotonic(), 0)))
            answer = await _answer(request, model, channel, asked, key, version)
    if _matches(if_none_match, answer.etag):
        return Response(status_code=304, headers={"ETag": answer.etag, "Cache-Control": "no-cache"})
    return answer


async def _answer(
    request: Request, model: str, channel: str, query: ResolveQuery, key: str | None, version: str | None
) -> Answer:
    """The rendered answer with its ETag: from memory on the event loop where it can be, else in a thread.

    The answer is a function of the member it is for, however it was chosen (the key's, the one named by
    `version`, or the primary), so the member's release keys the cache, never the key or the version."""
    cache: ResolveCache = request.app.state.resolve_cache
    row = cache.fingerprints.cached(model, channel)
    if row is not None:
        snapshot = snapshot_of(cache.fingerprints, model, channel, row)
        member = _member(snapshot, model, channel, key, version)
        hit = cache.answers.get(_answer_key(request, snapshot, member, model, channel, query))
        if hit is not None:
            return hit
    return await run_in_threadpool(_answer_from_database, request, model, channel, query, key, version)


def _member(snapshot: ChannelSnapshot, model: str, channel: str, key: str | None, version: str | None) -> SnapshotKey:
    return snapshot.choose(model, channel, key) if version is None else snapshot.member(model, channel, version)


def _answer_key(
    request: Request, snapshot: ChannelSnapshot, member: SnapshotKey, model: str, channel: str, query: ResolveQuery
) -> tuple[object, ...]:
    settings: RegistrySettings = request.app.state.settings  # not a dependency: solving one costs more
    return (snapshot.fingerprint, member.release_id, model, channel, query, base_url(request, settings))


def _answer_from_database(
    request: Request, model: str, channel: str, query: ResolveQuery, key: str | None, version: str | None
) -> Answer:
    """`_answer` where it must ask the database (blocking: in a thread): the channel, and on a miss the rest."""
    state = request.app.state
    cache: ResolveCache = state.resolve_cache
    sessions = state.session_factory
    snapshot = channel_snapshot(cache.fingerprints, sessions, model, channel)
    member = _member(snapshot, model, channel, key, version)
    answer_key = _answer_key(request, snapshot, member, model, channel, query)
    hit = cache.answers.get(answer_key)
    if hit is not None:
        return hit
    base = base_url(request, state.settings)
    query.pools  # noqa: B018 - parsed (and a bad one refused) before anything else is read
    catalog = load_catalog(sessions, snapshot.revision, cache)
    with sessions() as session:
        view = load_release_view(session, model, member, snapshot.revision, cache)
    ranked = rank_candidates(view, catalog, query, channel)
    best, *rest = (_candidate_out(c, base, model, view.version) for c in ranked)
    answer = ResolveOut(
        model=model,
        channel=channel,
        version=view.version,
        hardware=ranked[0].hardware,
        policy=query.policy,
        artifact=best.artifact,
        reason=best.reason,
        explanation=explain_choice(ranked, query),
        fallbacks=rest,
        split=_split_out(snapshot, view.version),
    )
    body = answer.model_dump_json().encode()
    rendered = Answer(body, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
    cache.answers.put(answer_key, rendered)
    return rendered
