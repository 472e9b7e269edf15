"""How a transformers forward holds a model's weights: whole, or streamed one decoder layer at a time.

The plan decides it once per stage (`hold`, called by `pipeline.requirements` with the stage's footprint
either way and the memory budget of the device it computes on) and sizes the stage's memory for what it
chose; the stage hands the decision to the runtime (`eval.runtimes.layer_stream.open_transformers`):

- the model whole when its footprint fits the budget (or the architecture does not stream): the weights
  are read once, and a greedy continuation decodes on the KV cache with nothing read again;
- else one layer at a time, each layer read once for every window (and every teacher-forced sequence) of
  a call, and the output head once per window. Up to `resident_bytes` (what the budget leaves over the
  streamed footprint) stay cast on the device after their first use: the head first, then, for a stage that
  decodes (the reference's own greedy continuation, one token at a time), the layers in order; only what is
  not kept is read again, for each window (the head) or each generated token: about 1 + n x the
  non-resident share passes over the weights for n tokens (the prompts' prefill is one of them).

The logits are the same either way, bit for bit (tests/eval/test_layer_stream.py), so the decision is not
part of any cache key: it changes what a stage holds and reads, which its provenance records
(`core.usage.WeightReads`), not what it computes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Residency(BaseModel):
    """`whole`: the model loaded whole; else streamed by layer, keeping up to `resident_bytes` of the cast
    head (then layers) loaded after their first use."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    whole: bool
    resident_bytes: int = Field(default=0, ge=0)

    def describe(self) -> str:
        """What a stage's provenance says of it: "whole", "streamed" or "streamed, N MiB resident"."""
        if self.whole:
            return "whole"
        mib = self.resident_bytes / 2**20
        amount = f"{mib:,.0f} MiB" if mib >= 10 else f"{self.resident_bytes:,} bytes"
        resident = f", up to {amount} resident" if self.resident_bytes else ""
        return "streamed by layer" + resident


WHOLE = Residency(whole=True)
STREAMED = Residency(whole=False)


def hold(budget: int | None, *, streams: bool, whole: int, streamed: int, resident: int = 0) -> Residency:
    """How a stage holds the model, given the memory `budget` of its device (None: unknown) and what it needs
    there holding it `whole` or `streamed`: whole when the architecture does not stream or when that fits;
    else streamed, keeping resident up to `resident` bytes (the cast head, and every layer for a stage that
    decodes) of what the budget leaves over the streamed footprint."""
    if not streams or (budget is not None and whole <= budget):
        return WHOLE
    spare = 0 if budget is None else max(0, budget - streamed)
    return Residency(whole=False, resident_bytes=min(resident, spare))
