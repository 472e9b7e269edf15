"""Kubernetes names and labels for rendered objects, from kiln's names (which allow more than they do).

Sources: Kubernetes' object names and label syntax (apimachinery `validation.IsDNS1123Label`,
`IsDNS1035Label`, `IsQualifiedName`, `IsValidLabelValue`). A name that would lose characters or length is
made unique with a hash of what it stands for, never silently merged with another.
"""

from __future__ import annotations

import hashlib
import re

LABEL_PREFIX = "kiln.dev"
MODEL_LABEL = f"{LABEL_PREFIX}/model"
CHANNEL_LABEL = f"{LABEL_PREFIX}/channel"
HARDWARE_LABEL = f"{LABEL_PREFIX}/hardware"
RELEASE_LABEL = f"{LABEL_PREFIX}/release"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kiln"}

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_HASH_CHARS = 8


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_CHARS]


def dns_label(*parts: str, max_length: int = 63) -> str:
    """A DNS-1035 label (lower-case letters, digits and '-', starting with a letter) naming `parts`.

    Characters outside it become '-'; a name that had to be cut to `max_length`, or that starts
    with a digit, ends with a hash of `parts`, so two different names never become one."""
    raw = "-".join(parts)
    name = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", raw.lower())).strip("-")
    if name and name[0].isalpha() and len(name) <= max_length:
        return name
    head = name[: max_length - _HASH_CHARS - 3].strip("-")
    if not head[:1].isalpha():
        head = f"k-{head}".strip("-")
    return f"{head}-{_digest(raw)}"


def label_value(value: str) -> str:
    """`value` as a label value: itself where Kubernetes accepts it, else its legal characters and a hash."""
    if len(value) <= 63 and _LABEL_VALUE.fullmatch(value):
        return value
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "-", value)[: 63 - _HASH_CHARS - 1].strip("-_.")
    return f"{cleaned}-{_digest(value)}" if cleaned else _digest(value)


def version_slug(version: str) -> str:
    """A release version as a part of a DNS label (1.5.0 -> 1-5-0)."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", version.lower())).strip("-") or _digest(version)


def unique(names: list[str], sources: list[str], max_length: int = 63) -> list[str]:
    """`names`, with a hash of its source added to each that another one shares (1.4.0 and 1-4-0)."""
    seen: dict[str, int] = {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
    return [
        n if seen[n] == 1 else f"{n[: max_length - _HASH_CHARS - 1]}-{_digest(s)}"
        for n, s in zip(names, sources, strict=True)
    ]
