"""Prometheus metrics of the control plane: sandboxes by state and lifecycle step durations.

A registry per app (so tests and several installations in one process do not clash). Called by
controlplane.lifecycle (observations) and controlplane.api (`/metrics`).
"""

from __future__ import annotations

import typing

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _StateCollector:
    def __init__(self, count: typing.Callable[[], dict[str, int]]):
        self._count = count

    def collect(self):
        g = GaugeMetricFamily("atoll_sandboxes", "Sandboxes by lifecycle state", labels=["state"])
        counts = self._count()
        for st in ("creating", "running", "standby", "failed", "deleted"):
            g.add_metric([st], counts.get(st, 0))
        yield g


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.lifecycle = Histogram(
            "atoll_lifecycle_duration_seconds",
            "Duration of sandbox lifecycle steps (create, pause_memory, pause_disk, resume_memory, resume_disk, delete)",
            ["verb", "outcome"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.requests = Histogram(
            "atoll_api_request_duration_seconds",
            "API request durations",
            ["route", "status"],
            buckets=BUCKETS,
            registry=self.registry,
        )

    def bind_state_counts(self, count: typing.Callable[[], dict[str, int]]) -> None:
        self.registry.register(_StateCollector(count))

    def render(self) -> bytes:
        return generate_latest(self.registry)
