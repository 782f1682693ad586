"""Placement policy: which worker takes a sandbox. Pure; called by controlplane.ledger (`place`),
benchmarked by bench/bench_placement.py.

A candidate is a worker that is ready (not lost, not draining), has the template (or the build),
whose memory can hold the sandbox at all, and that has a free slot (its `--slots` limit on the
sandboxes holding its resources: creating, running or in the memory tier, pool members included;
those in the disk or archive tier hold only disk and take no slot). Then:

1. **Affinity first when it has room.** A worker named by `prefer` (the one holding the sandbox's
   snapshot or its volumes, or the build) takes it when it is a candidate and the sandbox fits in
   what is left of its memory and CPUs ("resume there when it has room, elsewhere otherwise").
2. **Best of K by commitment.** Otherwise K candidates (default 2) are sampled at random and the
   least committed wins: commitment is the larger of the memory and CPU shares the worker would
   have allocated with this sandbox. Sampling K rather than always taking the emptiest keeps a
   burst of creates from piling onto one worker between two updates of the allocations.
3. **Ties** (commitments within 5 points of each other) go to the worker that holds the
   affinity, then to the one with fewer sandboxes of the same tenant (spread by tenant — one
   tenant's fleet does not sit on one machine), then to the one with fewer sandboxes, then by name.

Memory and CPU are overcommitted on purpose (most sandboxes are idle or in standby): only a sandbox
larger than a worker's whole memory cannot go there. Slots are the hard limit: a worker whose slots
are all taken is never chosen, and when every worker is out of them the error names what each one
hit (its slots, its memory, its templates) and how to make room. Each decision carries its reason,
which the ledger logs.

`commitments` sums what the live records hold per worker in one pass (memory and slots of those in
RAM, CPUs of those running, disk of those not archived), so a placement among W workers with N
sandboxes costs O(N + W), not O(N × W).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from atoll.core import errors
from atoll.core.lifecycle import State, Tier

TIE_BAND = 0.05
"""Commitments closer than this count as equal (then affinity, tenant spread and counts decide)."""


class Held(Protocol):
    """What placement reads of a sandbox record (controlplane.db.SandboxRecord has these)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def tenant_id(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def standby_tier(self) -> str | None: ...
    @property
    def memory_mb(self) -> int: ...
    @property
    def cpus(self) -> float: ...
    @property
    def disk_mb(self) -> int: ...


@dataclass
class Commitment:
    """What one worker's live sandboxes hold."""

    memory_mb: int = 0
    cpus: float = 0.0
    disk_mb: int = 0
    slots: int = 0
    """Sandboxes holding its resources: creating, running, memory tier (pool members too)."""
    sandboxes: int = 0
    by_tenant: dict[str, int] = field(default_factory=dict)


def commitments(records: Iterable[Held]) -> dict[str, Commitment]:
    """Per worker id: memory and slots of the sandboxes in RAM (creating, running, memory tier),
    CPUs of those running or creating, disk of all but the archived (their layers are in the
    store), counts."""
    out: dict[str, Commitment] = {}
    active_states = (State.CREATING, State.RUNNING)
    archive, memory = Tier.ARCHIVE, Tier.MEMORY
    for rec in records:
        # the record's loaded attributes straight from its __dict__ when they are all there: an ORM
        # attribute read costs ~10x a dict lookup, and this runs over every live record per placement
        try:
            d = rec.__dict__
            wid, tenant, state, tier = d["worker_id"], d["tenant_id"], d["state"], d["standby_tier"]
            mem, cpus, disk = d["memory_mb"], d["cpus"], d["disk_mb"]
        except (AttributeError, KeyError):
            wid, tenant, state, tier = rec.worker_id, rec.tenant_id, rec.state, rec.standby_tier
            mem, cpus, disk = rec.memory_mb, rec.cpus, rec.disk_mb
        c = out.get(wid)
        if c is None:
            c = out[wid] = Commitment()
        c.sandboxes += 1
        by = c.by_tenant
        by[tenant] = by.get(tenant, 0) + 1
        if tier != archive:
            c.disk_mb += disk
        if state in active_states:
            c.memory_mb += mem
            c.cpus += cpus
            c.slots += 1
        elif tier == memory:
            c.memory_mb += mem
            c.slots += 1
    return out


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    name: str
    memory_mb: int
    allocated_memory_mb: int
    templates: frozenset[str]
    cpus: float = 0.0
    """The worker's CPUs (0: unknown, CPU is then left out of its commitment)."""
    allocated_cpus: float = 0.0
    sandboxes: int = 0
    tenant_sandboxes: int = 0
    """Sandboxes it holds of the tenant being placed."""
    slots: int = 0
    """Its limit on sandboxes holding its resources (`atoll worker --slots`; 0: none)."""
    allocated_slots: int = 0
    """Slots taken (Commitment.slots, plus resumes in flight)."""

    @property
    def slots_full(self) -> bool:
        return 0 < self.slots <= self.allocated_slots

    @property
    def free_mb(self) -> int:
        return self.memory_mb - self.allocated_memory_mb

    def commitment(self, memory_mb: int, cpus: float) -> float:
        """The larger of its memory and CPU shares with a sandbox of this size added."""
        mem = (self.allocated_memory_mb + memory_mb) / self.memory_mb if self.memory_mb > 0 else 1.0
        cpu = (self.allocated_cpus + cpus) / self.cpus if self.cpus > 0 else 0.0
        return max(mem, cpu)

    def has_room(self, memory_mb: int, cpus: float) -> bool:
        return self.commitment(memory_mb, cpus) <= 1.0


@dataclass(frozen=True)
class Decision:
    worker: Candidate
    reason: str
    """Why this worker, in words (logged by the ledger)."""


def decide(
    candidates: Sequence[Candidate],
    *,
    memory_mb: int,
    template: str | None,
    cpus: float = 0.0,
    prefer: str | None = None,
    k: int = 2,
    rng: random.Random | None = None,
) -> Decision:
    """The worker for a sandbox of `memory_mb`, `cpus` and `template` (None: any worker will do —
    an archived sandbox brings its template's layers through the store), with the reason; or an
    error saying why none fits. `prefer`: the worker id with affinity."""
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
    open_ = [c for c in fits if not c.slots_full]
    if not open_:
        raise errors.Unavailable(
            no_room(candidates, memory_mb=memory_mb, template=template), code="no_worker"
        )
    if prefer is not None:
        home = next((c for c in open_ if c.worker_id == prefer), None)
        if home is not None and home.has_room(memory_mb, cpus):
            return Decision(home, f"affinity: {home.name} holds its state and has room")
    pick = rng if rng is not None else random.Random()
    sample = pick.sample(open_, k) if len(open_) > k else list(open_)
    best = min(c.commitment(memory_mb, cpus) for c in sample)
    tied = [c for c in sample if c.commitment(memory_mb, cpus) - best <= TIE_BAND]
    win = min(
        tied,
        key=lambda c: (c.worker_id != prefer, c.tenant_sandboxes, c.sandboxes, c.name),
    )
    why = f"least committed of {len(sample)} sampled ({win.commitment(memory_mb, cpus):.0%} with it)"
    if len(tied) > 1:
        if win.worker_id == prefer:
            why += "; affinity broke the tie"
        else:
            why += f"; tie of {len(tied)} broken by fewest of the tenant's sandboxes ({win.tenant_sandboxes})"
    if prefer is not None and win.worker_id != prefer:
        why += "; the worker with affinity had no room or was not ready"
    return Decision(win, why)


SLOTS_FIX = (
    "free a slot (delete a sandbox, or pause one to the disk tier: POST /v1/sandboxes/{id}/pause "
    '{"tier": "disk"}), start the worker with more (`atoll worker --slots N` or ATOLL_WORKER_SLOTS, '
    "`atoll up --slots N`), or add a worker"
)


def no_room(candidates: Sequence[Candidate], *, memory_mb: int, template: str | None) -> str:
    """Why none of `candidates` can take a sandbox: the limit each one hit, and how to make room."""
    why = []
    for c in candidates:
        if template is not None and template not in c.templates:
            why.append(f"{c.name}: does not have template {template!r}")
        elif memory_mb > c.memory_mb:
            why.append(f"{c.name}: memory {c.memory_mb} MB is less than the {memory_mb} MB asked")
        elif c.slots_full:
            why.append(f"{c.name}: slots full ({c.allocated_slots} of {c.slots} taken)")
    return f"no worker can take the sandbox ({'; '.join(why)}); {SLOTS_FIX}"
