"""Release commands against a registry: seal, abandon, promote, split, yank, resolve, and the audit log."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from kiln.cli.common import DEFAULT_REGISTRY, JsonOpt, RegistryOpt, answer, app, emit, fmt_size, split_ref, stamp
from kiln.client import RegistryClient
from kiln.console import err, safe_text, stdout


@app.command()
def seal(
    ref: Annotated[str, typer.Argument(metavar="MODEL@VERSION")],
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Seal an open release once every planned artifact is published with its eval (`kiln publish` does this)."""
    model, version = split_ref(ref)
    with RegistryClient.connect(registry) as client:
        out = client.seal_release(model, version)
    answer(out, as_json, f"{model}@{version} sealed: {len(out.planned_artifacts)} artifacts")


@app.command()
def abandon(
    ref: Annotated[str, typer.Argument(metavar="MODEL@VERSION")],
    reason: Annotated[str, typer.Option(help="Why; recorded in the audit log.")],
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Abandon an open release that will never be sealed: its artifacts are dropped, `kiln gc` collects their blobs."""
    model, version = split_ref(ref)
    with RegistryClient.connect(registry) as client:
        out = client.abandon_release(model, version, reason)
    answer(out, as_json, f"{model}@{version} abandoned: {reason}")


@app.command()
def promote(
    ref: Annotated[str, typer.Argument(metavar="MODEL@VERSION")],
    channel: Annotated[str, typer.Option(help="Channel to point at the release, e.g. prod.")],
    force: Annotated[bool, typer.Option(help="Promote although an eval gate failed (needs --reason).")] = False,
    reason: Annotated[str | None, typer.Option(help="Why; recorded in the audit log.")] = None,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Point CHANNEL of MODEL at VERSION (refused while an artifact failed its eval gate)."""
    model, version = split_ref(ref)
    with RegistryClient.connect(registry) as client:
        out = client.promote(model, version, channel, force=force, reason=reason, actor=os.environ.get("USER"))
    answer(out, as_json, f"{model}: channel {channel} -> {version}" + (" (forced)" if force else ""))


@app.command()
def split(
    model: str,
    weights: Annotated[list[str], typer.Argument(metavar="VERSION=PERCENT...", help="e.g. 1.4.0=95 1.5.0=5")],
    channel: Annotated[str, typer.Option(help="Channel to split, e.g. prod.")],
    force: Annotated[bool, typer.Option(help="Include a release whose eval gate failed (needs --reason).")] = False,
    reason: Annotated[str | None, typer.Option(help="Why; recorded in the audit log.")] = None,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Split CHANNEL of MODEL over releases with weights (a canary); `VERSION=100` alone rolls back or forward."""
    parsed: dict[str, float] = {}
    for item in weights:
        version, sep, percent = item.partition("=")
        try:
            parsed[version] = float(percent) if sep else float("nan")
        except ValueError:
            parsed[version] = float("nan")
        if not sep or parsed[version] != parsed[version]:
            raise typer.BadParameter(f"{item!r}: expected VERSION=PERCENT, e.g. 1.5.0=5")
    with RegistryClient.connect(registry) as client:
        out = client.set_split(model, channel, parsed, force=force, reason=reason, actor=os.environ.get("USER"))
    members = ", ".join(f"{m.version} {m.weight:g} %" for m in out.members())
    answer(out, as_json, f"{model}: channel {channel} -> {members}")


@app.command()
def yank(
    ref: Annotated[str, typer.Argument(metavar="MODEL@VERSION")],
    reason: Annotated[str, typer.Option(help="Why; recorded in the audit log.")],
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Yank a release: it stays stored, but resolve and downloads by channel never return it again."""
    model, version = split_ref(ref)
    with RegistryClient.connect(registry) as client:
        out = client.yank(model, version, reason)
    answer(out, as_json, f"{model}@{version} yanked: {reason}")


# The files a human answer lists (an orbax checkpoint has hundreds); --json lists all.
LISTED_FILES = 8


@app.command()
def resolve(
    model: str,
    hardware: Annotated[
        str, typer.Option(help="Hardware pools, best first, optionally with free devices: h100 or h100:4,mi300x.")
    ],
    channel: Annotated[str, typer.Option(help="Channel to resolve.")] = "prod",
    context: Annotated[int, typer.Option(help="Context length to size the KV cache for.")] = 4096,
    concurrency: Annotated[int, typer.Option(help="Concurrent sequences per replica.")] = 1,
    policy: Annotated[str, typer.Option(help="latency | cost | quality.")] = "latency",
    kv_cache_dtype: Annotated[str, typer.Option(help="bf16 | fp8.")] = "bf16",
    min_tokens_per_s: Annotated[float | None, typer.Option(help="SLO: decode tokens/s per sequence.")] = None,
    max_ttft_ms: Annotated[float | None, typer.Option(help="SLO: time to first token, ms.")] = None,
    key: Annotated[str | None, typer.Option(help="Request or session id: a stable release of a split.")] = None,
    version: Annotated[
        str | None, typer.Option(help="A release of the channel (a split member): answer for it, not with --key.")
    ] = None,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """Which artifact a pool of HARDWARE should load for MODEL on CHANNEL, on how many devices, and why."""
    with RegistryClient.connect(registry) as client:
        answer = client.resolve(
            model,
            hardware,
            channel,
            context=context,
            concurrency=concurrency,
            policy=policy,
            kv_cache_dtype=kv_cache_dtype,
            min_tokens_per_s=min_tokens_per_s,
            max_ttft_ms=max_ttft_ms,
            key=key,
            version=version,
        )
    if as_json:
        emit(answer.model_dump(mode="json"))
        return
    a, why = answer.artifact, answer.reason
    stdout.print(
        safe_text(f"{answer.model}@{answer.version} ({answer.channel}) on {answer.hardware}: {a.name}, TP {why.tp}")
    )
    stdout.print(f"  {safe_text(answer.explanation)}")
    stdout.print(f"  {safe_text(why.explanation)}")
    if answer.split:
        shares = ", ".join(f"{m.version} {m.weight:g} %" for m in answer.split)
        stdout.print(safe_text(f"  split: {shares}"))
    for f in a.files[:LISTED_FILES]:
        stdout.print(safe_text(f"  {f.path}  sha256:{f.sha256}  {f.size} bytes"))
        stdout.print(f"    {safe_text(f.url)}")
    if len(a.files) > LISTED_FILES:
        count, total = len(a.files), fmt_size(sum(f.size for f in a.files))
        more = count - LISTED_FILES
        stdout.print(f"  ... and {more} more files ({count} in all, {total}; --json lists every one)")
    if answer.fallbacks:
        names = ", ".join(f"{fb.artifact.name}@{fb.hardware}" for fb in answer.fallbacks)
        stdout.print(safe_text("  fallbacks: " + names))
    if not registry.startswith(("http://", "https://")):
        err.print(f"[dim]embedded registry: `kiln serve --data-dir {safe_text(registry)}` serves these URLs[/dim]")


@app.command()
def audit(
    model: Annotated[str | None, typer.Option(help="Only events about this model.")] = None,
    limit: Annotated[int, typer.Option(help="How many events, newest first.")] = 50,
    registry: RegistryOpt = DEFAULT_REGISTRY,
    as_json: JsonOpt = False,
) -> None:
    """The audit log: promotions, forced promotions, yanks and token changes (who, what, when, why)."""
    with RegistryClient.connect(registry) as client:
        events = client.audit(model, limit)
    if as_json:
        emit(events)
        return
    for e in events:
        why = f"  reason: {e.reason}" if e.reason else ""
        change = e.details
        before_after = f"  {change.get('before')} -> {change.get('after')}" if "after" in change else ""
        stdout.print(safe_text(f"{stamp(e.at)}  {e.actor:<28} {e.action:<24} {e.target}{before_after}{why}"))
