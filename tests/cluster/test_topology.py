"""The topology suite (issue 21, `make test-cluster`): two `atoll server`s (A, B) on one PostgreSQL
database, three `atoll worker`s (w0, w1, w2: each its own ATOLL_HOME, w0 and w2 with `--server A,B`,
w1 with `--server B,A`, so both servers hold workers) sharing one S3 store (SeaweedFS on loopback),
real gVisor sandboxes. One topology for the module; its tests run in order and each leaves every
process up again:

1. both servers list the three workers; creates spread over them; a create retried with its
   Idempotency-Key through the other server answers the same sandbox;
2. a worker SIGKILLed during a burst of execs and a pause: its sandboxes answer 503
   worker_unavailable (never 500) and show `worker_state: "lost"`; after ATOLL_WORKER_GONE_S the one
   with `on_worker_lost: "restore"` runs on another worker as of its archive, the others fail; the
   worker restarted (same home) does not bring the moved one back;
3. a server SIGKILLed during a burst of creates: its workers join the other server, the leader
   lease moves, every acknowledged create is there and usable; the server restarted;
4. a worker drained with running and standby sandboxes: all move, their files with them.

Every server serves every worker's sandboxes (controlplane.workers borrows the workers other
servers hold), so every sandbox call goes through `Topology.through(sid)`: a server that does *not*
hold the sandbox's worker, where there is one."""

from __future__ import annotations

import concurrent.futures
import os
import time
import typing

import httpx
import pytest

from atoll.testing import LocalServer, LocalWorker, purge
from atoll.testing.seaweed import SeaweedFS
from tests.conftest import PG_TEMPLATE, TEMPLATE_CACHE

pytestmark = [pytest.mark.cluster, pytest.mark.integration]

WORKERS = {"w0": "AB", "w1": "BA", "w2": "AB"}
"""Each worker and the order of the servers in its --server."""
LOST_S = 8
"""ATOLL_WORKER_LOST_S: above the 5 s at which a server writes heartbeats to the shared records
(controlplane.workers.HEARTBEAT_WRITE_S), which is how another server tells a worker is alive."""
GONE_S = 5
"""ATOLL_WORKER_GONE_S."""


class Topology:
    def __init__(self, servers: dict[str, LocalServer], workers: dict[str, LocalWorker]):
        self.servers = servers
        self.workers = workers
        self._clients: dict[str, httpx.Client] = {}
        self.unacknowledged: list[str] = []
        """The Idempotency-Keys of the creates a SIGKILLed server never answered."""

    def client(self, server: str) -> httpx.Client:
        s = self.servers[server]
        if server not in self._clients:
            self._clients[server] = httpx.Client(base_url=s.url, headers=s.headers(), timeout=300)
        return self._clients[server]

    def alive(self) -> list[str]:
        return [n for n, s in self.servers.items() if s.proc is not None]

    def workers_on(self, server: str) -> dict[str, dict]:
        """GET /v1/workers through `server`, by name ({} when it does not answer)."""
        try:
            return {w["name"]: w for w in self.client(server).get("/v1/workers", timeout=10).json()["items"]}
        except (httpx.HTTPError, ValueError, KeyError):
            return {}

    def holder(self, worker: str) -> str | None:
        """The server the worker is registered with now (ready or draining there, not borrowed:
        the other servers list it ready too, "held by another server")."""
        for s in self.alive():
            w = self.workers_on(s).get(worker, {})
            if w.get("state") in ("ready", "draining") and "held by another server" not in (
                w.get("state_reason") or ""
            ):
                return s
        return None

    def through(self, sid: str) -> httpx.Client:
        """A server that does not hold the sandbox's worker but calls it (every server serves every
        worker's sandboxes on shared records); the holder while no other one lists it ready yet,
        and any live server when no server holds it."""
        first = self.client(self.alive()[0])
        worker = first.get(f"/v1/sandboxes/{sid}").json().get("worker")
        holder = self.holder(worker) if worker else None
        for s in self.alive():
            if s != holder and self.workers_on(s).get(worker, {}).get("state") in ("ready", "draining"):
                return self.client(s)
        return self.client(holder or self.alive()[0])

    def wait(self, what: str, test: typing.Callable[[], typing.Any], timeout: float = 120) -> typing.Any:
        deadline = time.monotonic() + timeout
        while True:
            got = test()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s\n{self.logs()}")
            time.sleep(0.2)

    def wait_placed(self, timeout: float = 120) -> dict[str, str]:
        """Every worker ready on some server: worker -> server."""

        def placed():
            where = self.placement()
            return where if all(where.values()) else None

        return self.wait("every worker ready on a server", placed, timeout)

    def placement(self) -> dict[str, str | None]:
        """worker -> the server it is ready on (None: on none now)."""
        return {w: self.holder(w) for w in self.workers}

    def leader(self) -> str | None:
        for s in self.alive():
            try:
                items = self.client(s).get("/v1/leases", timeout=10).json()["items"]
            except (httpx.HTTPError, ValueError, KeyError):
                continue
            if any(x["name"] == "leader" and x["this_server"] for x in items):
                return s
        return None

    def logs(self) -> str:
        """What each live server lists (state and reason of every worker), then each process's
        last log lines: what a failed wait shows."""
        seen = [
            f"--- {s} lists: "
            + "; ".join(
                f"{n}={w.get('state')} ({w.get('state_reason')})" for n, w in self.workers_on(s).items()
            )
            for s in self.alive()
        ]
        tails = [f"--- {n}:\n{p.tail(40)}" for n, p in {**self.servers, **self.workers}.items()]
        return "\n".join(seen + tails)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()


@pytest.fixture(scope="module")
def topology(tmp_path_factory, postgres):
    if os.geteuid() != 0:
        pytest.skip("atoll worker needs root (run `make test-cluster`)")
    root = tmp_path_factory.mktemp("topology")
    key_file = root / "secrets.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    db_name = f"topology_{os.getpid()}"
    seaweed = SeaweedFS(str(root / "seaweed"))
    servers: dict[str, LocalServer] = {}
    workers: dict[str, LocalWorker] = {}
    topo = Topology(servers, workers)
    try:
        seaweed.start()
        env = {
            "ATOLL_DATABASE_URL": postgres.create_database(db_name, template=PG_TEMPLATE),
            "ATOLL_SECRETS_KEY_FILE": str(key_file),
            "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
            "ATOLL_HEARTBEAT_S": "1",
            "ATOLL_WORKER_LOST_S": str(LOST_S),
            "ATOLL_WORKER_GONE_S": str(GONE_S),
            **seaweed.env(),
        }
        servers["A"] = LocalServer(root / "A", env=env)
        servers["B"] = LocalServer(root / "B", api_key=servers["A"].api_key, env=env)
        servers["A"].start()
        servers["B"].start()
        for name, order in WORKERS.items():
            urls = ",".join(servers[s].url for s in order)
            workers[name] = LocalWorker(
                root / name, urls, servers["A"].api_key, name, env=env, worker_key=True
            ).start()
        topo.wait_placed(900)
        yield topo
    finally:
        for w in workers.values():  # a worker a test left killed: back, so its sandboxes are deleted
            if w.proc is None:
                w.start()
        for s in servers.values():
            if s.proc is None:
                s.start()
        try:
            topo.wait_placed(60)
        except AssertionError:
            pass
        for s in servers:
            for sid in _ids(topo, s):
                try:
                    topo.through(sid).delete(f"/v1/sandboxes/{sid}", timeout=60)
                except httpx.HTTPError:
                    pass
        for w in workers.values():
            LocalServer.wait_no_sandboxes(w.home, timeout=30)
            w.terminate()
        for s in servers.values():
            s.terminate()
        for w in workers.values():
            purge(w.home)
        topo.close()
        seaweed.close()
        try:
            postgres.drop_database(db_name)
        except Exception:  # noqa: BLE001 - the cluster goes with the session anyway
            pass


def _ids(topo: Topology, server: str) -> list[str]:
    try:
        return [sb["id"] for sb in topo.client(server).get("/v1/sandboxes").json()["items"]]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def _exec(c: httpx.Client, sid: str, cmd: str) -> str:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
    return r.json()["stdout"]


def _create(c: httpx.Client, **body) -> dict:
    r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0, **body})
    assert r.status_code == 201, r.text
    return r.json()


def _cordon(topo: Topology, names: typing.Iterable[str], on: bool) -> None:
    """Drain without evacuation (`on`), or undo it: creates then avoid these workers."""
    for name in names:
        server = topo.holder(name)
        assert server, f"{name} is not ready anywhere\n{topo.logs()}"
        c = topo.client(server)
        wid = topo.workers_on(server)[name]["id"]
        r = c.post(
            f"/v1/workers/{wid}/drain",
            json={"draining": on, "evacuate": False} if on else {"draining": False},
        )
        assert r.status_code in (200, 202), r.text
    # the other servers, which call these workers too, read the cordon from the records (≤ 5 s)
    want = "draining" if on else "ready"
    topo.wait(
        f"every server lists {sorted(names)} {want}",
        lambda: all(topo.workers_on(s).get(n, {}).get("state") == want for s in topo.alive() for n in names),
        30,
    )


def _unavailable_or_ok(r: httpx.Response) -> None:
    """A call to a sandbox whose worker died meanwhile: done, or 503 worker_unavailable."""
    if r.status_code == 503:
        assert r.json()["error"]["code"] == "worker_unavailable", r.text
    else:
        assert r.status_code == 200, r.text


def test_both_servers_list_every_worker_creates_spread_and_a_key_holds_across_servers(topology):
    topo = topology
    for s in ("A", "B"):  # a server learns the workers of the other from the records every 5 s
        topo.wait(f"{s} listing every worker", lambda s=s: sorted(topo.workers_on(s)) == sorted(WORKERS), 15)
    assert topo.wait_placed() == {"w0": "A", "w1": "B", "w2": "A"}

    made = [_create(topo.client(s)) for s in ("A", "B", "A", "A", "B", "A")]
    assert {sb["worker"] for sb in made} == set(WORKERS), [sb["worker"] for sb in made]
    for sb in made:
        assert _exec(topo.through(sb["id"]), sb["id"], "echo hi") == "hi\n"

    # a create whose answer was lost, retried through the other server: the same sandbox
    first = topo.client("A").post(
        "/v1/sandboxes", json={"idle_timeout_s": 0}, headers={"Idempotency-Key": "k-1"}
    )
    assert first.status_code == 201, first.text
    again = topo.client("B").post(
        "/v1/sandboxes", json={"idle_timeout_s": 0}, headers={"Idempotency-Key": "k-1"}
    )
    assert again.status_code == 201 and again.json()["id"] == first.json()["id"], again.text
    reused = topo.client("B").post(
        "/v1/sandboxes", json={"idle_timeout_s": 60}, headers={"Idempotency-Key": "k-1"}
    )
    assert reused.status_code == 409 and reused.json()["error"]["code"] == "idempotency_key_reused", (
        reused.text
    )
    for sid in [sb["id"] for sb in made] + [first.json()["id"]]:
        assert topo.through(sid).delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_a_killed_worker_is_unavailable_then_restored_elsewhere_and_not_resurrected(topology):
    topo = topology
    where = topo.wait_placed()
    # the victim: a worker of the server that does not run the background loops, so that the
    # leader settles a worker another server held
    leader = topo.wait("a leader", topo.leader, 60)
    victim = next(w for w, s in where.items() if s != leader)
    server = where[victim]
    c = topo.client(server)
    others = [w for w in WORKERS if w != victim]
    _cordon(topo, others, True)
    try:
        made = {
            "restored": _create(c, on_worker_lost="restore"),
            "plain": _create(c),
            "paused": _create(c),
        }
    finally:
        _cordon(topo, others, False)
    assert {sb["worker"] for sb in made.values()} == {victim}, made
    ids = {k: sb["id"] for k, sb in made.items()}
    sid = ids["restored"]
    assert c.put(
        f"/v1/sandboxes/{sid}/files", params={"path": "/root/notes"}, content=b"archived"
    ).status_code in (200, 201, 204)
    r = c.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "archive"})
    assert r.status_code == 200 and r.json()["standby_tier"] == "archive", r.text
    assert _exec(c, sid, "cat /root/notes") == "archived"  # resumed: its archive stays in the store
    c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/notes"}, content=b"after the archive")
    for k in ("plain", "paused"):
        c.put(f"/v1/sandboxes/{ids[k]}/files", params={"path": "/root/notes"}, content=k.encode())

    # mid-operation: a burst of execs on two sandboxes and a pause in flight
    def one_exec(k: str) -> httpx.Response:
        with httpx.Client(base_url=c.base_url, headers=c.headers, timeout=120) as own:
            return own.post(f"/v1/sandboxes/{ids[k]}/exec", json={"cmd": "sleep 0.5; echo ok"})

    def pause() -> httpx.Response:
        with httpx.Client(base_url=c.base_url, headers=c.headers, timeout=120) as own:
            return own.post(f"/v1/sandboxes/{ids['paused']}/pause", json={"tier": "disk"})

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        execs = [pool.submit(one_exec, k) for k in ("restored", "plain") * 4]
        paused = pool.submit(pause)
        time.sleep(0.3)
        t0 = time.monotonic()
        topo.workers[victim].kill()  # SIGKILL, its process group: its runsc sandboxes live on
        answers = [f.result() for f in execs] + [paused.result()]
    for r in answers:
        _unavailable_or_ok(r)
    print(f"answers while {victim} died: {sorted(r.status_code for r in answers)}")

    # lost: shown so, and every call answers 503 worker_unavailable, never 500
    for k, s in ids.items():
        sb = topo.wait(
            f"{k} shown lost",
            lambda s=s: (v := c.get(f"/v1/sandboxes/{s}").json())["worker_state"] == "lost" and v,
            30,
        )
        assert sb["worker"] == victim, sb
        r = c.post(f"/v1/sandboxes/{s}/exec", json={"cmd": "true"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable", r.text

    # after ATOLL_WORKER_GONE_S: the restored one runs elsewhere as of its archive, the others fail
    def moved():
        sb = topo.through(sid).get(f"/v1/sandboxes/{sid}").json()
        return sb["worker"] != victim and sb["state"] == "running" and sb

    sb = topo.wait("the restored sandbox running on another worker", moved, 120)
    print(f"{victim} killed -> restored on {sb['worker']}: {time.monotonic() - t0:.1f} s")
    assert _exec(topo.through(sid), sid, "cat /root/notes") == "archived"
    for k in ("plain", "paused"):
        s = ids[k]
        sb = topo.wait(
            f"{k} failed",
            lambda s=s: (v := c.get(f"/v1/sandboxes/{s}").json())["state"] == "failed" and v,
            60,
        )
        assert "worker gone" in sb["failure_reason"] and repr(victim) in sb["failure_reason"], sb

    # the worker comes back (same home): it drops its copies, nothing runs again there
    topo.workers[victim].start()
    topo.wait(f"{victim} back", lambda: topo.holder(victim), 120)
    sandboxes_dir = os.path.join(topo.workers[victim].home, "sandboxes")
    topo.wait(
        f"{victim} dropping its copies",
        lambda: not set(os.listdir(sandboxes_dir)) & set(ids.values()),
        60,
    )
    c = topo.through(sid)
    sb = c.get(f"/v1/sandboxes/{sid}").json()
    assert sb["worker"] != victim and sb["state"] == "running", sb
    assert _exec(c, sid, "cat /root/notes") == "archived"
    for s in ids.values():
        assert topo.through(s).delete(f"/v1/sandboxes/{s}").status_code == 204


def test_a_killed_server_hands_over_its_workers_and_loses_no_acknowledged_create(topology):
    topo = topology
    where = topo.wait_placed()
    victim = topo.wait("a leader", topo.leader, 60)
    survivor = next(s for s in topo.servers if s != victim)
    assert victim in where.values(), where
    before = {}
    for s in (victim, survivor):
        sb = _create(topo.client(s))
        topo.client(s).put(
            f"/v1/sandboxes/{sb['id']}/files", params={"path": "/root/notes"}, content=s.encode()
        )
        before[sb["id"]] = s
    url = topo.servers[victim].url
    headers = topo.servers[victim].headers()

    def create(i: int) -> httpx.Response | Exception:
        try:
            with httpx.Client(base_url=url, headers=headers, timeout=120) as own:
                return own.post(
                    "/v1/sandboxes", json={"idle_timeout_s": 0}, headers={"Idempotency-Key": f"burst-{i}"}
                )
        except httpx.HTTPError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        burst = [pool.submit(create, i) for i in range(8)]
        concurrent.futures.wait(burst, timeout=60, return_when=concurrent.futures.FIRST_COMPLETED)
        t0 = time.monotonic()
        topo.servers[victim].kill()  # SIGKILL: no lease released, no goodbye to its workers
        answers = [f.result() for f in burst]
    acked = [r.json()["id"] for r in answers if isinstance(r, httpx.Response) and r.status_code == 201]
    for r in answers:
        assert isinstance(r, Exception) or r.status_code in (201, 503), r.text
    print(f"creates acknowledged before {victim} died: {len(acked)} of {len(answers)}")
    assert acked, answers

    # every worker joins the survivor; it takes the leader lease
    topo.wait("the workers on the survivor", lambda: set(topo.placement().values()) == {survivor}, 90)
    moved_s = time.monotonic() - t0
    assert topo.wait("the lease", topo.leader, 60) == survivor
    print(
        f"{victim} killed -> every worker on {survivor} in {moved_s:.1f} s, lease in {time.monotonic() - t0:.1f} s"
    )

    c = topo.client(survivor)
    for sid in acked:  # no acknowledged create lost: each there and usable
        assert _exec(topo.through(sid), sid, "echo ok") == "ok\n"
    for sid, s in before.items():
        assert _exec(topo.through(sid), sid, "cat /root/notes") == s

    # the creates it never acknowledged: each either made (and kept) or dropped, none left creating
    def settled():
        states = {sb["id"]: sb["state"] for sb in c.get("/v1/sandboxes").json()["items"]}
        return "creating" not in states.values() and states

    states = topo.wait("the unacknowledged creates settled", settled, 90)
    print(f"after the kill: {sorted(states.values())}")
    topo.unacknowledged = [
        f"burst-{i}"
        for i, r in enumerate(answers)
        if not (isinstance(r, httpx.Response) and r.status_code == 201)
    ]

    # the killed server comes back: it lists every worker (they stay on the survivor)
    topo.servers[victim].start()
    assert sorted(topo.workers_on(victim)) == sorted(WORKERS)
    assert set(topo.wait_placed().values()) == {survivor}
    for sid in list(before) + acked:
        assert topo.through(sid).delete(f"/v1/sandboxes/{sid}").status_code == 204
    # whatever the creates that were never acknowledged made is deleted (none is promised)
    for sb in c.get("/v1/sandboxes").json()["items"]:
        c.delete(f"/v1/sandboxes/{sb['id']}")


def test_a_create_its_server_never_answered_is_answered_by_the_other_on_retry(topology):
    """The client of a create that its server died under retries it with its Idempotency-Key
    through the other server: it should get the sandbox that create made (or a new one when none
    was made), promptly."""
    topo = topology
    if not topo.unacknowledged:
        pytest.skip("every create of the burst was acknowledged")
    survivor = topo.wait("a leader", topo.leader, 60)
    try:
        r = topo.client(survivor).post(
            "/v1/sandboxes",
            json={"idle_timeout_s": 0},
            headers={"Idempotency-Key": topo.unacknowledged[0]},
            timeout=15,
        )
    except httpx.ReadTimeout:
        pytest.fail("the retry waited on the dead server's pending key")
    assert r.status_code == 201, r.text
    # the sandbox that create made may be the one the previous test's clean-up deleted since (the
    # key answers it as made): gone then, else deleted now
    assert topo.through(r.json()["id"]).delete(f"/v1/sandboxes/{r.json()['id']}").status_code in (204, 404)


def test_a_drained_worker_hands_over_running_and_standby_sandboxes(topology):
    topo = topology
    where = topo.wait_placed()
    victim = "w0"
    server = where[victim]
    c = topo.client(server)
    others = [w for w in WORKERS if w != victim]
    _cordon(topo, others, True)
    try:
        made = {k: _create(c)["id"] for k in ("running", "disk", "memory")}
    finally:
        _cordon(topo, others, False)
    for k, sid in made.items():
        assert c.get(f"/v1/sandboxes/{sid}").json()["worker"] == victim
        c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/notes"}, content=k.encode())
    for tier in ("disk", "memory"):
        r = c.post(f"/v1/sandboxes/{made[tier]}/pause", json={"tier": tier})
        assert r.status_code == 200 and r.json()["standby_tier"] == tier, r.text

    wid = topo.workers_on(server)[victim]["id"]
    r = c.post(f"/v1/workers/{wid}/drain", json={})
    assert r.status_code == 202, r.text

    def ended():
        w = c.get(f"/v1/workers/{wid}").json()
        return w["evacuation"] and w["evacuation"]["state"] != "running" and w

    w = topo.wait("the evacuation", ended, 300)
    assert w["evacuation"]["state"] == "done" and w["evacuation"]["moved"] == 3, w
    assert not w["evacuation"]["left"] and w["evacuated"], w
    for k, sid in made.items():
        sb = topo.through(sid).get(f"/v1/sandboxes/{sid}").json()
        assert sb["worker"] != victim, sb
        assert _exec(topo.through(sid), sid, "cat /root/notes") == k
    assert c.post(f"/v1/workers/{wid}/drain", json={"draining": False}).status_code == 200
    for sid in made.values():
        assert topo.through(sid).delete(f"/v1/sandboxes/{sid}").status_code == 204
