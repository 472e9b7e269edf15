"""One 70B release with bf16, FP8, GPTQ and the FP4 bundles: which one each SKU's pool resolves to.

The artifacts are what kiln's hf-bundle writes for `examples/llama-3-70b` (sizes from `quant.footprint`,
hardware from the catalog's verdicts), with the example model's measured KL. Decode is a roofline
(`placement.fit`): many short sequences make it FLOP-bound, where the format the device computes
natively wins (NVFP4 on B200, MXFP4 on MI355X, FP8 on H100); one long sequence is bandwidth-bound, where the
smallest weights win. H200's bounds rest on its measured shares (core/hardware.yaml): its FP8 GEMMs reach 0.659 of
1,979 TFLOP/s and its bf16 ones 0.754 of 989, so per sequence bf16 on TP 4 (twice FP8's devices) is faster, and
per token FP8 on TP 2 still cheaper.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.core.hardware import builtin_catalog
from kiln.core.manifest import ArtifactIdentity
from kiln.core.shape import ShapeRecord
from kiln.quant.catalog import compatibility, get_scheme
from kiln.quant.footprint import checkpoint_bytes
from kiln.registry.resolve.query import ResolveQuery
from kiln.registry.resolve.ranking import rank_candidates
from kiln.registry.resolve.views import ArtifactView, FileView, ReleaseView

CONFIG = json.loads((Path(__file__).resolve().parents[2] / "examples/llama-3-70b/config.json").read_text())
# The example model's KL against its reference, per scheme (docs/evaluation.md, "The example model's quality").
KL = {
    "bf16": 0.0,
    "fp8": 9.2e-4,
    "w4a16-gptq": 8.7e-4,
    "nvfp4-w4a4": 1.2e-2,
    "nvfp4-w4a16": 3.0e-3,
    "mxfp4-w4a4": 2.1e-2,
}


def _artifact(quant: str) -> ArtifactView:
    verdicts = compatibility(get_scheme(quant))
    size = checkpoint_bytes(CONFIG, quant)
    return ArtifactView(
        identity=ArtifactIdentity(
            name=f"hf-bundle-{quant}",
            target="hf-bundle",
            format="safetensors",
            quant=quant,
            hardware=[h for h, v in verdicts.items() if v.compatible],
        ),
        manifest_digest="0" * 64,
        unsupported={h: v.reason for h, v in verdicts.items() if not v.compatible},
        total_size=size,
        eval_status="passed",
        kl=KL[quant],
        failed_reasons=(),
        files=(FileView("model.safetensors", "0" * 64, size),),
    )


RELEASE = ReleaseView("llama-3-70b", "1.0", ShapeRecord.from_untrusted(CONFIG), tuple(_artifact(q) for q in KL))


@pytest.mark.parametrize(
    ("hardware", "policy", "pick"),
    [
        *((hw, policy, pick) for hw, pick in (("b200", "nvfp4-w4a4"), ("mi355x", "mxfp4-w4a4"), ("h100", "fp8"))
          for policy in ("latency", "cost")),
        ("h200", "cost", "fp8"),
        ("h200", "latency", "bf16"),
    ],
)  # fmt: skip
def test_a_throughput_workload_resolves_to_the_format_the_device_computes(
    hardware: str, policy: str, pick: str
) -> None:
    query = ResolveQuery(hardware, policy=policy, context=256, concurrency=2048)  # type: ignore[arg-type]
    best, *fallbacks = rank_candidates(RELEASE, builtin_catalog(), query, "prod")
    assert best.artifact.identity.quant == pick and best.fits, best.explanation
    assert "decode FLOP-bound at 2048 sequences" in best.plan.explanation
    assert fallbacks and all(c.artifact.identity.quant != pick for c in fallbacks)
    assert best.plan.basis.decode == ("measured" if hardware == "h200" else "spec")


def test_what_a_device_cannot_run_is_never_offered() -> None:
    query = ResolveQuery("mi300x", context=256, concurrency=2048)
    offered = {c.artifact.identity.quant for c in rank_candidates(RELEASE, builtin_catalog(), query, "prod")}
    assert offered == {"bf16", "fp8", "w4a16-gptq"}  # no FP4 on gfx942
    query = ResolveQuery("mi355x", context=256, concurrency=2048)
    offered = {c.artifact.identity.quant for c in rank_candidates(RELEASE, builtin_catalog(), query, "prod")}
    assert "nvfp4-w4a4" not in offered and "nvfp4-w4a16" not in offered and "mxfp4-w4a4" in offered


@pytest.mark.parametrize("hardware", ["b200", "mi355x", "h100"])
def test_one_long_sequence_is_bandwidth_bound_and_takes_the_smallest_weights(hardware: str) -> None:
    query = ResolveQuery(hardware, context=4096, concurrency=1)
    best = rank_candidates(RELEASE, builtin_catalog(), query, "prod")[0]
    assert best.artifact.identity.quant == "w4a16-gptq" and "FLOP-bound" not in best.plan.explanation
