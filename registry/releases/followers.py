"""What the domains above releases do when a release changes, handed down to the release routes.

Channels and model cars sit above releases in the registry's layers (docs/registry.md): they read releases,
so releases never import them. `create_app` hands the release routes their answers instead
(`ReleaseFollowers`, on `app.state.release_followers`): the channels that serve a release (named in its
detail, and in a yank's audit record), taking a yanked release out of the channels' splits, and, where the
registry offers model cars, recording a sealed release's layers once the seal is answered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session

from kiln.storage.store import BlobStore


@dataclass(frozen=True)
class ReleaseFollowers:
    """The channels' and model cars' part in a release's life (`registry.app.create_app` fills it)."""

    # (session, release id) -> the names of the channels that serve it, pointing at it or splitting to it.
    serving: Callable[[Session, int], list[str]]
    # (session, model, release id, version, actor): a yanked release leaves every split, in the yank's
    # transaction.
    yanked: Callable[[Session, str, int, str, str], object]
    # (write sessions, blob store, release id): run after a seal is answered; None where nothing follows.
    sealed: Callable[[Callable[[], Session], BlobStore, int], None] | None = None
