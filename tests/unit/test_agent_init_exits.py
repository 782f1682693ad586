"""guest.agent.processes: exits reported by atoll-init never hold up the spawns in flight.

The init client's one reader thread reads both the answers to spawns and the exit messages. An exit
of a command nobody waits for any more (killed when its caller went away) used to be delivered on
that thread, which waited up to 60 s for the spawns in flight to register — while the spawn in
flight waited for its answer on the same thread: the next exec hung 60 s and failed with 137."""

from __future__ import annotations

import threading
import types

from atoll.guest.agent import processes


class _Init:
    """Stands in for InitClient.spawn: the answer arrives only when `answered` is set, as the
    reader thread would hand it over."""

    pid = 0

    def __init__(self, pid: int) -> None:
        self.answered = threading.Event()
        self.child = pid

    def spawn(self, argv, **_kw):
        assert self.answered.wait(10), "the spawn's answer never came: the reader thread was blocked"
        return types.SimpleNamespace(pid=self.child, stdout=None, stderr=None)


def _table(init: _Init) -> processes.ProcessTable:
    table = processes.ProcessTable()
    table.init = init  # type: ignore[assignment]
    table.start_exit_delivery()
    return table


def _spawn_in_thread(table) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def go():
        out["proc"], _ = table.spawn(
            ["true"],
            cmd=["true"],
            background=False,
            cwd="/",
            env={},
            user_kwargs={},
            stdout=None,
            stderr=None,
        )

    th = threading.Thread(target=go)
    th.start()
    return th, out


def _wait_inflight(table) -> None:
    for _ in range(1000):
        with table._cond:
            if table._inflight:
                return
        threading.Event().wait(0.001)
    raise AssertionError("the spawn never started")


def test_an_exit_of_a_forgotten_command_does_not_block_the_reader_while_a_spawn_waits():
    init = _Init(pid=42)
    table = _table(init)
    th, out = _spawn_in_thread(table)
    _wait_inflight(table)
    # the reader thread: the exit of a command that was forgotten, then the spawn's answer
    reader = threading.Thread(target=lambda: (table._exit_reported(7, 137), init.answered.set()))
    reader.start()
    reader.join(2)
    assert not reader.is_alive(), "reporting an exit blocked the init client's reader thread"
    th.join(10)
    assert out["proc"].pid == 42 and out["proc"].exit_code is None


def test_an_exit_reported_before_its_spawner_registered_still_reaches_it():
    init = _Init(pid=43)
    table = _table(init)
    th, out = _spawn_in_thread(table)
    _wait_inflight(table)
    # the answer, then at once the command's exit, before the spawner had the time to register it
    init.answered.set()
    table._exit_reported(43, 3)
    th.join(10)
    proc = out["proc"]
    assert proc.ended.wait(10)
    assert proc.exit_code == 3


class _DyingInit(_Init):
    """An init that answers a spawn and dies before the spawner registers the command (the command
    was `kill -9 1`): its restart looks at the running commands before this one is in the table."""

    epoch = 0

    def spawn(self, argv, **_kw):
        answer = types.SimpleNamespace(pid=self.child, stdout=None, stderr=None, epoch=self.epoch)
        self.epoch += 1  # InitClient.died, then its restart thread calls _init_restarting
        self.table._init_restarting()
        return answer


def test_a_command_whose_init_died_before_it_was_registered_is_reported_killed():
    init = _DyingInit(77)
    table = init.table = _table(init)
    proc, _ = table.spawn(
        ["sh", "-c", "kill -9 1"], cmd="kill -9 1", background=False, cwd="/", env={}, user_kwargs={},
        stdout=None, stderr=None,
    )  # fmt: skip
    # before: nothing ever reported its exit, and the exec waited for its timeout (90 s)
    assert proc.ended.wait(5) and proc.exit_code == 128 + 9
