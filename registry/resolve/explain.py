"""Why resolve chose what it chose, in one sentence."""

from __future__ import annotations

from kiln.registry.resolve.query import ResolveQuery
from kiln.registry.resolve.ranking import Candidate

_POLICY_WORDS = {
    "latency": "the fastest per sequence",
    "cost": "the cheapest per million tokens",
    "quality": "the lowest KL divergence from the reference",
}


def explain_choice(ranked: list[Candidate], query: ResolveQuery) -> str:
    """One sentence on why the first candidate won under the policy."""
    best = ranked[0]
    eligible = sum(c.fits and c.meets_slo for c in ranked)
    slo = []
    if query.min_tokens_per_s is not None:
        slo.append(f"≥ {query.min_tokens_per_s:g} tokens/s per sequence")
    if query.max_ttft_ms is not None:
        slo.append(f"TTFT ≤ {query.max_ttft_ms:g} ms")
    meets = f" meeting {' and '.join(slo)}" if slo else ""
    return (
        f"policy {query.policy}: {best.artifact.identity.name} on {best.hardware} (TP {best.plan.tp}) is "
        f"{_POLICY_WORDS[query.policy]} of {eligible} candidate{'s' if eligible != 1 else ''} that fit"
        f"{meets} across {', '.join(p.hardware for p in query.pools)}"
    )
