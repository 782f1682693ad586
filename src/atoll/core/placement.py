"""Placement policy: which worker takes a new sandbox. Pure; called by controlplane.lifecycle.

A candidate is a worker that is ready (not lost, not draining), has the template, and whose memory
can hold the sandbox at all. Among those, two are sampled at random and the one with more memory
left after what is allocated there wins ("best of two": nearly as even as always taking the
emptiest, without every create of a burst piling onto the same worker). Memory is overcommitted on
purpose (most sandboxes are idle or in standby); only a sandbox larger than a worker's whole
memory cannot go there. Affinity to the worker holding a snapshot, tenant spread and CPU weighting
come with scale-out.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from atoll.core import errors


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    name: str
    memory_mb: int
    allocated_memory_mb: int
    templates: frozenset[str]

    @property
    def free_mb(self) -> int:
        return self.memory_mb - self.allocated_memory_mb


def choose(
    candidates: Sequence[Candidate], *, memory_mb: int, template: str | None, rng: random.Random | None = None
) -> Candidate:
    """The worker for a sandbox of `memory_mb` and `template` (None: any worker will do — an
    archived sandbox brings its template's layers through the store), or an error saying why none
    fits."""
    if not candidates:
        raise errors.Unavailable(
            "no worker is ready to take a sandbox; start one (`atoll worker --server URL --name NAME`) "
            "or wait for the registered ones to come back (GET /v1/workers)",
            code="no_worker",
        )
    with_template = (
        list(candidates) if template is None else [c for c in candidates if template in c.templates]
    )
    if not with_template:
        known = sorted(set().union(*(c.templates for c in candidates)))
        raise errors.TemplateNotFound(
            f"template {template!r} does not exist; available templates: {', '.join(known) or 'none'}"
        )
    fits = [c for c in with_template if memory_mb <= c.memory_mb]
    if not fits:
        most = max(c.memory_mb for c in with_template)
        raise errors.InvalidRequest(
            f"memory_mb={memory_mb} is more than any worker's memory (the largest has {most} MB); "
            f"ask for at most {most} MB (less leaves room for other sandboxes)"
        )
    pick = rng if rng is not None else random.Random()
    pair = pick.sample(fits, 2) if len(fits) > 2 else fits
    return max(pair, key=lambda c: (c.free_mb, c.name))
