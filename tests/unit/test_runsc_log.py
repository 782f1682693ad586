"""runsc's log of a failure (worker.host.runsc `cause`, `keep_log`): what a failed checkpoint's
record says, and the copy that outlives the sandbox (issue 21: a sentry panic in a checkpoint)."""

from __future__ import annotations

import os

from atoll.worker.host import runsc

PANIC = """\
I1207 00:17:36.123456       1 main.go:222] ***************************
panic: saving endpoint: endpoint cannot be saved in connected state [recovered]
\tpanic: saving endpoint: endpoint cannot be saved in connected state

goroutine 123 [running]:
gvisor.dev/gvisor/pkg/state.Save.func1()
\t/build/gvisor/pkg/state/state.go:161 +0x55
panic({0x1234560, 0xc000abcdef})
\t/usr/lib/go/src/runtime/panic.go:884 +0x213
gvisor.dev/gvisor/pkg/tcpip/transport/tcp.(*endpoint).beforeSave(0xc000123400)
\t/build/gvisor/pkg/tcpip/transport/tcp/endpoint_state.go:52 +0x1a5
created by gvisor.dev/gvisor/pkg/sentry/control.(*State).Save
\t/build/gvisor/pkg/sentry/control/state.go:60 +0x2c
checkpoint failed: checkpointing container "atoll-abc-x-1": writing image {HOME}/sandboxes/sb-x/snapshot.tmp-1: EOF
"""


def test_the_cause_is_the_panic_and_the_last_words_without_frames_or_host_paths(tmp_path):
    home = str(tmp_path / "home")
    log = tmp_path / "runsc.log"
    log.write_text("started\n" + PANIC.replace("{HOME}", home))
    cause = runsc.cause(str(log), home)
    assert cause == (
        "panic: saving endpoint: endpoint cannot be saved in connected state [recovered] | "
        'checkpoint failed: checkpointing container "atoll-abc-x-1": writing image '
        "$ATOLL_HOME/sandboxes/sb-x/snapshot.tmp-1: EOF"
    )
    assert home not in cause and "goroutine" not in cause and "beforeSave" not in cause


def test_the_cause_without_a_panic_is_the_last_line_and_is_short(tmp_path):
    log = tmp_path / "runsc.log"
    log.write_text('checkpoint failed: cannot checkpoint container "c" in state stopped\n')
    assert runsc.cause(str(log)) == 'checkpoint failed: cannot checkpoint container "c" in state stopped'
    log.write_text("x" * 5000 + "\n")
    assert len(runsc.cause(str(log))) == 400
    assert runsc.cause(str(tmp_path / "missing.log")) == "(no runsc log)"


def test_keep_log_copies_the_end_privately_and_keeps_the_newest(tmp_path, monkeypatch):
    monkeypatch.setattr(runsc, "KEPT_LOG_BYTES", 10)
    monkeypatch.setattr(runsc, "KEPT_LOGS", 3)
    log = tmp_path / "runsc.log"
    log.write_text("old lines\nthe end\n")
    logs = str(tmp_path / "logs")
    kept = []
    for i in range(5):
        path = runsc.keep_log(str(log), logs, f"sb-{i}-checkpoint-1.log")
        assert path is not None
        os.utime(path, ns=(i * 10**9, i * 10**9))  # the copies' ages, oldest first
        kept.append(path)
    assert open(kept[-1]).read() == "old lines\nthe end\n"[-10:]
    assert os.stat(kept[-1]).st_mode & 0o777 == 0o600 and os.stat(logs).st_mode & 0o777 == 0o700
    assert sorted(os.listdir(logs)) == [
        "sb-2-checkpoint-1.log",
        "sb-3-checkpoint-1.log",
        "sb-4-checkpoint-1.log",
    ]
    assert runsc.keep_log(str(tmp_path / "missing.log"), logs, "sb-9-checkpoint-1.log") is None
