"""HTTP route for resolve."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from core.hardware import get_profile
from registry.api.errors import error_responses
from registry.api.lean_route import LeanRoute
from registry.api.params import CHANNEL_PATTERN, MODEL_NAME_PATTERN
from registry.api.urls import artifact_file_url, base_url
from registry.artifacts.schemas import FileOut
from registry.deps import require
from registry.resolve.schemas import ResolveCandidate, ResolvedArtifact, ResolveOut, ResolveReason
from registry.resolve.service import (
    Candidate,
    ResolveCache,
    channel_snapshot,
    load_release_view,
    rank_candidates,
)
from registry.settings import RegistrySettings

# Lean: the hot path, answered by the app's LeanLane in front of FastAPI's per-request machinery
# (registry.api.lean_route). The lane runs the router's own dependencies: it declares its READ.
router = APIRouter(prefix="/v1", tags=["resolve"], route_class=LeanRoute, dependencies=[require("read")])


def _candidate_out(c: Candidate, base: str, model: str, version: str) -> ResolveCandidate:
    a = c.artifact
    return ResolveCandidate(
        artifact=ResolvedArtifact(
            name=a.name,
            target=a.target,
            format=a.format,
            quant=a.quant,
            manifest_digest=a.manifest_digest,
            files=[
                FileOut(
                    path=f.path,
                    sha256=f.sha256,
                    size=f.size,
                    url=artifact_file_url(base, model, version, a.name, f.path),
                )
                for f in a.files
            ],
        ),
        reason=ResolveReason(
            fits=c.fits,
            weights_bytes=c.weights_bytes,
            kv_cache_bytes=c.kv_cache_bytes,
            memory_bytes=c.memory_bytes,
            required_bytes=c.required_bytes,
            decode_tokens_per_s_bound=c.decode_tokens_per_s_bound,
            eval_status=a.eval_status,
            explanation=c.explanation,
        ),
    )


@router.get(
    "/resolve",
    summary="The artifact a node of this hardware should load from a channel, why, and ranked fallbacks",
    response_model=ResolveOut,
    responses=error_responses(404, 422),
)
async def resolve(
    request: Request,
    model: Annotated[str, Query(pattern=MODEL_NAME_PATTERN)],
    hardware: Annotated[str, Query(description="hardware profile name, e.g. h100, cpu")],
    channel: Annotated[str, Query(pattern=CHANNEL_PATTERN)] = "prod",
    context: Annotated[int, Query(ge=1, le=10_000_000, description="tokens of context per sequence")] = 4096,
    concurrency: Annotated[int, Query(ge=1, le=100_000, description="sequences served at once")] = 1,
) -> Response:
    # async, and rendered here rather than by FastAPI: no thread hop and no second validation of
    # the answer on the hot path. With warm caches the work is one indexed query (on the resolve
    # cache's own connection, no session) and a dict lookup; a session is opened only on a miss.
    profile = get_profile(hardware)
    state = request.app.state  # not dependencies: each one solved costs more than this route's own work
    settings: RegistrySettings = state.settings
    cache: ResolveCache = state.resolve_cache
    sessions = state.session_factory
    snapshot = channel_snapshot(cache.fingerprints, sessions, model, channel)
    base = base_url(request, settings)
    answer_key = (snapshot, model, channel, profile.name, context, concurrency, base)
    body = cache.answers.get(answer_key)
    if body is None:
        with sessions() as session:
            view = load_release_view(session, model, snapshot, cache)
        ranked = rank_candidates(view, profile, context, concurrency, channel)
        best, *rest = (_candidate_out(c, base, model, view.version) for c in ranked)
        answer = ResolveOut(
            model=model,
            channel=channel,
            version=view.version,
            hardware=profile.name,
            artifact=best.artifact,
            reason=best.reason,
            fallbacks=rest,
        )
        body = answer.model_dump_json().encode()
        cache.answers.put(answer_key, body)
    return Response(body, media_type="application/json")
