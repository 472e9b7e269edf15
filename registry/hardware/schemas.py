"""API shapes for the hardware catalog."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.hardware import HardwareProfile


class HardwareOut(HardwareProfile):
    source: Literal["builtin", "registry", "registry (overrides builtin)"] = Field(
        description="kiln's built-in catalog, or an entry admins gave this registry"
    )
