"""Prometheus metrics of one registry app, in its own registry (several apps may share a process in tests).

With `kiln serve --workers N` every worker is its own process: when PROMETHEUS_MULTIPROC_DIR is set
(`registry.server` sets it for N > 1) the values are written there and `/metrics` sums every worker's.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RegistryMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kiln_http_requests", "HTTP requests answered", ("method", "route", "status"), registry=self.registry
        )
        self.latency = Histogram(
            "kiln_http_request_duration_seconds",
            "Time to answer an HTTP request (to the last body byte)",
            ("method", "route"),
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.bytes_served = Counter(
            "kiln_http_response_bytes", "Response body bytes sent", ("route",), registry=self.registry
        )
        self.publishes = Counter(
            "kiln_artifact_publishes", "Artifacts newly published", ("target",), registry=self.registry
        )

    def exposition(self) -> bytes:
        """The text format for `/metrics`: this process's values, or every worker's when multiprocess."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            combined = CollectorRegistry()
            multiprocess.MultiProcessCollector(combined)
            return bytes(generate_latest(combined))
        return bytes(generate_latest(self.registry))
