"""API shapes for channels and promotions."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.registry.api.params import VERSION_PATTERN


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str = Field(pattern=VERSION_PATTERN)
    force: bool = Field(default=False, description="promote despite failed eval gates; needs a reason")
    reason: str | None = Field(default=None, max_length=10_000)
    actor: str | None = Field(default=None, max_length=128, description="who asks (recorded in history)")

    @model_validator(mode="after")
    def _forced_needs_reason(self) -> PromoteRequest:
        if self.force and not (self.reason and self.reason.strip()):
            raise ValueError("a forced promotion needs a non-empty reason")
        return self


MAX_SPLIT_MEMBERS = 8
BASIS_POINTS = 10_000  # a split's weights, in hundredths of a percent


class SplitWeight(BaseModel):
    """One member of a split: a percent of the traffic from 0.01 to 100 in steps of 0.01 (one basis point,
    one of the 10,000 key buckets), so every member owns at least one bucket. A JSON number (integer or
    decimal), never a string or a boolean."""

    model_config = ConfigDict(extra="forbid")

    version: str = Field(pattern=VERSION_PATTERN)
    weight: float = Field(
        strict=True, ge=0.01, le=100, allow_inf_nan=False, description="percent of the traffic, 0.01 to 100, to 0.01"
    )

    @property
    def basis_points(self) -> int:
        return round(self.weight * 100)

    @model_validator(mode="after")
    def _hundredths(self) -> SplitWeight:
        # Relative to the weight: 0.07 * 100 is 7.000000000000001, 1e-10 * 100 is not a basis point.
        if self.basis_points < 1 or abs(self.weight * 100 - self.basis_points) > 1e-9 * self.basis_points:
            raise ValueError(f"weight {self.weight} is not a multiple of 0.01 %")
        return self


class SplitRequest(BaseModel):
    """A channel's traffic over releases, e.g. 95 % to 1.4.0 and 5 % to 1.5.0:
    `{"weights": [{"version": "1.4.0", "weight": 95}, {"version": "1.5.0", "weight": 5}]}`."""

    model_config = ConfigDict(extra="forbid")

    weights: list[SplitWeight] = Field(min_length=1, max_length=MAX_SPLIT_MEMBERS)
    force: bool = Field(default=False, description="include releases that failed eval gates; needs a reason")
    reason: str | None = Field(default=None, max_length=10_000)
    actor: str | None = Field(default=None, max_length=128, description="who asks (recorded in history)")

    @model_validator(mode="after")
    def _valid_split(self) -> SplitRequest:
        versions = [w.version for w in self.weights]
        if len(set(versions)) != len(versions):
            raise ValueError(f"a release is listed twice: {versions}")
        total = sum(w.basis_points for w in self.weights)
        if total != BASIS_POINTS:
            raise ValueError(f"weights sum to {total / 100:g} %, not 100 %")
        if self.force and not (self.reason and self.reason.strip()):
            raise ValueError("a forced split needs a non-empty reason")
        return self
