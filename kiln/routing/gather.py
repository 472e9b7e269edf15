"""What a render needs from a registry, through the client: resolve's answer for every release of the channel
on every hardware pool, and (for model cars) the tags the registry serves.

The split is read from resolve's own answers: the first names the channel's members (or its one
release), then each (pool, release) is asked with `version=`. Every answer carries the split it was
given under; if the channel changed while it was read (a member gone, other weights), it is read
again, so a render never mixes two splits.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from kiln.client import RegistryClient
from kiln.core.error_codes import Codes
from kiln.core.errors import Conflict, InvalidInput, KilnError, NotFound
from kiln.core.hardware import Family
from kiln.core.manifest import ArtifactIdentity
from kiln.core.resolve import ResolveOut
from kiln.registry.channels.buckets import BASIS_POINTS
from kiln.registry.resolve.query import Pool, parse_pools
from kiln.routing.kserve import MODELCAR_REPOSITORY, modelcar_tag
from kiln.routing.records import ChannelRouting, Placement, PoolRouting, Sizing
from kiln.routing.runtimes import runtime_for

ATTEMPTS = 3  # reads of a channel whose split keeps changing before giving up


class _SplitMoved(Exception):
    """The channel's split changed between two answers: read it again."""


def parse_pool_options(pools: Sequence[str]) -> tuple[Pool, ...]:
    """`--pool h100:8 --pool mi300x:8`: each an SKU with its free devices (resolve's grammar); at least one."""
    if not pools:
        raise InvalidInput(
            "no hardware pools: name each with --pool, e.g. --pool h100:8 --pool mi300x:8",
            code=Codes.ROUTING_NO_POOLS,
        )
    if any("," in p for p in pools):
        raise InvalidInput(
            "one pool per --pool (h100:8), not a list", code=Codes.ROUTING_POOL_INVALID, details={"pools": list(pools)}
        )
    try:
        return parse_pools(",".join(p.strip() for p in pools))
    except InvalidInput as exc:
        raise InvalidInput(exc.message, code=Codes.ROUTING_POOL_INVALID, details={"pools": list(pools)}) from None


def _spec(pool: Pool) -> str:
    return pool.hardware + (f":{pool.free_devices}" if pool.free_devices is not None else "")


def _split_of(answer: ResolveOut) -> tuple[tuple[str, int], ...]:
    if answer.split is None:
        return ((answer.version, BASIS_POINTS),)
    return tuple((m.version, round(m.weight * BASIS_POINTS / 100)) for m in answer.split)


def _resolve(
    client: RegistryClient, model: str, channel: str, pool: Pool, sizing: Sizing, version: str | None
) -> ResolveOut:
    try:
        return client.resolve(
            model,
            _spec(pool),
            channel,
            context=sizing.context,
            concurrency=sizing.concurrency,
            policy=sizing.policy,
            kv_cache_dtype=sizing.kv_cache_dtype,
            version=version,
        )
    except NotFound as exc:
        if exc.code == Codes.VERSION_NOT_IN_CHANNEL:
            raise _SplitMoved from None
        if "channels" in exc.details:  # the model has no such channel: nothing was promoted to it
            known = ", ".join(exc.details["channels"]) or "none"
            raise NotFound(
                f"channel {channel!r} of {model!r} points at no release (its channels: {known}); "
                f"promote one first: kiln promote {model}@VERSION --channel {channel}",
                code=Codes.ROUTING_CHANNEL_EMPTY,
                details={"model": model, "channel": channel, "channels": exc.details["channels"]},
            ) from None
        if exc.code in (Codes.NO_COMPATIBLE_ARTIFACT, Codes.SLO_UNMET):  # resolve's own, with the pool and release
            where = f"pool {_spec(pool)}" + (f", release {version}" if version else "")
            raise type(exc)(
                f"{where}: {exc.message}", code=exc.code, details={**exc.details, "pool": _spec(pool)}
            ) from None
        raise


def _placement(answer: ResolveOut, weight: int) -> Placement:
    a, why = answer.artifact, answer.reason
    runtime = runtime_for(a.target, a.format)
    if runtime.fixed_tp is not None and why.tp != runtime.fixed_tp:
        raise InvalidInput(
            f"{a.name} of {answer.model}@{answer.version} on {answer.hardware} runs at TP {runtime.fixed_tp} only "
            f"({runtime.serves}), and its replica needs TP {why.tp} for this context and concurrency: "
            "lower them, or give the pool an artifact that shards",
            code=Codes.ROUTING_TP_UNSUPPORTED,
            details={"artifact": a.name, "hardware": answer.hardware, "tp": why.tp, "runs_at": runtime.fixed_tp},
        )
    return Placement(
        version=answer.version,
        weight=weight,
        artifact=ArtifactIdentity.of(a),
        manifest_digest=a.manifest_digest,
        tp=why.tp,
        runtime=runtime.name,
        explanation=why.explanation,
    )


def _read(
    client: RegistryClient,
    model: str,
    channel: str,
    pools: tuple[Pool, ...],
    sizing: Sizing,
    catalog: dict[str, Family],
) -> ChannelRouting:
    first = _resolve(client, model, channel, pools[0], sizing, None)
    split = _split_of(first)
    routed: list[PoolRouting] = []
    registry = ""
    for pool in pools:
        placements = []
        for version, weight in split:
            if pool is pools[0] and version == first.version:
                answer = first
            else:
                answer = _resolve(client, model, channel, pool, sizing, version)
            if _split_of(answer) != split:
                raise _SplitMoved
            placements.append(_placement(answer, weight))
            if answer.artifact.files and not registry:
                url = urlsplit(answer.artifact.files[0].url)
                registry = f"{url.scheme}://{url.netloc}"
        routed.append(
            PoolRouting(
                hardware=pool.hardware,
                family=catalog[pool.hardware],  # validated by PoolRouting
                free_devices=pool.free_devices,
                placements=tuple(placements),
            )
        )
    return ChannelRouting(
        model=model, channel=channel, registry=registry or client.location, sizing=sizing, pools=tuple(routed)
    )


def gather_routing(
    client: RegistryClient, model: str, channel: str, pools: Sequence[str], sizing: Sizing, *, modelcars: bool = False
) -> ChannelRouting:
    """Every release of `model`'s `channel` placed on every pool, as the registry resolves it now.

    With `modelcars`, each placement's model car must be among the registry's tags (ROUTING_NO_MODELCARS
    where it serves none, ROUTING_MODELCAR_MISSING where one is not served)."""
    parsed = parse_pool_options(pools)
    catalog = {h.name: h.family for h in client.hardware()}
    for _ in range(ATTEMPTS):
        try:
            routing = _read(client, model, channel, parsed, sizing, catalog)
            break
        except _SplitMoved:
            continue
    else:
        raise Conflict(
            f"the split of {model}'s channel {channel} changed while it was read, {ATTEMPTS} times; try again",
            code=Codes.ROUTING_SPLIT_CHANGING,
            details={"model": model, "channel": channel},
        )
    if modelcars:
        check_modelcars(client, routing)
    return routing


def check_modelcars(client: RegistryClient, routing: ChannelRouting) -> None:
    """Every placement's model car is a tag of the registry's `modelcar/<model>` repository."""
    repository = MODELCAR_REPOSITORY.format(model=routing.model)
    try:
        tags = set(client.oci_tags(repository))
    except KilnError as exc:
        if exc.code != Codes.NAME_UNKNOWN:
            raise
        raise NotFound(
            f"the registry serves no model cars for {routing.model} ({exc.message}); KServe pulls artifacts as "
            "model cars: configure the registry's base image (KILN_REGISTRY_MODELCAR_BASE, docs/oci.md)",
            code=Codes.ROUTING_NO_MODELCARS,
            details={"repository": repository},
        ) from None
    for pool in routing.pools:
        for p in pool.placements:
            tag = modelcar_tag(p.version, p.artifact.name)
            if tag not in tags:
                raise NotFound(
                    f"the registry has no model car {repository}:{tag} "
                    f"({p.artifact.name} of {routing.model}@{p.version})",
                    code=Codes.ROUTING_MODELCAR_MISSING,
                    details={"repository": repository, "tag": tag},
                )
