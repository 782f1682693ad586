"""atoll guest agent: the daemon that runs as PID 1 inside every gVisor sandbox.

The atoll worker on the host is its only client: it calls this agent over HTTP/1.1 on TCP to run
commands, move files, list and kill processes, check health, set the sandbox identity after a
restore or fork, and ask whether the sandbox can be checkpointed right now (`GET /gate`).

Deployment: at every start the worker (`atoll.worker.host.agent_pack`, called by `Worker.start()`)
packs this package into one file in `$ATOLL_HOME/agent`, bind-mounted read-only at /opt/atoll:
`agent.pyc` holds every module's bytecode, compiled by the worker's interpreter, and a small
importer that serves them from memory; `agent-source.pyz`, a zipapp of the .py files, is for
templates whose python3 is another version. The sandbox starts it as

    python3 -I -S -u /opt/atoll/agent.pyc --port 49999 [--host 0.0.0.0]

and a checkout runs it as `python -m atoll.guest.agent --host 127.0.0.1 --port N`. Imports inside
the package are relative (it is named `agent` inside both files). This module imports nothing: the
entry point (`__main__`) imports the rest.

Modules, bottom up:

  errors           ApiError (answered as JSON), BadRequest, PeerGone
  common           stderr logging, compact JSON, printable names, small /proc reads
  threads          the pool of reused daemon threads (connections, leftover pipe readers)
  proctree         SIGKILL a command's session, group and descendants
  zygote           starting atoll-init (a C program: atoll/guest/init/atoll-init.c), PID 1 of the
                   user processes' PID namespace, which spawns them and keeps them in the pids
                   cgroup inside the sandbox (1,024 user tasks, 512 per command)
  initclient       the agent's side of atoll-init (start, requests, restart after a kill)
  processes        process records, spawning (through atoll-init), the agent's reaper
  gate             what would make a checkpoint fail now (GET /gate, POST /gate/final)
  connection       HTTP/1.1 parsing and responses on one keep-alive connection
  capture          a command's output: captured head, ndjson stream, leftover drain
  procio           a background process's pipes: bounded output log by offset, pump, stdin pipe
  shells           bash -l -c (env re-exported after the profile) or sh -c for string commands
  handlers_status  GET /health, POST /identity, GET /gate, POST /gate/final
  handlers_exec    POST /exec, GET /processes, DELETE /processes/<pid>, POST /processes/kill-all
  handlers_procs   GET /processes/<pid>[/output], POST /processes/<pid>/stdin|signal|wait
  handlers_files   GET|PUT|DELETE /files, GET /files/list
  ptyframes        the framing of an attached terminal (the one definition; the host imports it too)
  ptys             terminals: POST|GET /pty, GET|DELETE /pty/<id>, GET /pty/<id>/attach (see there)
  routing          the Agent (shared state, mixing in the handlers) and its route table
  __main__         arguments, signals as PID 1, listen and accept

Standard library only (Python 3.11). Design rules, from measured gVisor behaviour:

* No epoll anywhere. gVisor cannot checkpoint a TCP endpoint registered with epoll ("endpoint still
  has waiters upon save"), so there is no asyncio/selectors: the main thread blocks in accept() and
  each connection gets a (pooled) thread doing blocking recv. A command's two pipes are read with a
  plain poll() by the thread serving the exec request: poll, like a blocking recv, registers nothing
  that outlives the call, and one thread instead of two reader threads saves ~50 futex calls of GIL
  hand-offs per exec.
* The agent never closes a connection first on the normal path (the closer keeps TIME_WAIT, which
  blocks a checkpoint for 60 s): HTTP/1.1 keep-alive, every response has Content-Length or is
  chunked, no `Connection: close` on success; the host closes (with RST). If the agent must end a
  connection (malformed request, or the client sent `Connection: close`) it waits up to 2 s for the
  client to close and otherwise resets it (SO_LINGER 0) rather than sending the first FIN.
* PID 1 duties. One reaper thread is the only code that collects exit statuses (waitpid(-1)):
  statuses of processes the agent started go to their records, orphans' statuses are dropped.
  subprocess.Popen objects are made inert right after the spawn so they never wait on a pid.
  SIGCHLD is reset to default, SIGPIPE is ignored (children get the default back through
  subprocess's restore_signals), SIGTERM/SIGINT SIGKILL the tracked process groups and exit 0.
* User commands never run beside the agent: atoll-init (`zygote`, a small C program beside
  agent.pyc), PID 1 of a child PID namespace
  with its own /proc, spawns them on the agent's request over a unix socketpair and reports their
  exits, so no command can see or signal the agent (`pkill python3`, `kill -9 1`). A killed init
  is restarted (its commands report 137), a stopped one continued. When the agent is not PID 1 (a
  checkout on the host) it spawns directly unless ATOLL_AGENT_ISOLATE=1.
* Syscalls are slow in gVisor (~50 us) and spawns ~9x slower than native: an exec of `true` is one
  Popen (vfork path unless switching users; no shell for argv commands), a poll loop and the
  reaper's wait4: about 30 syscalls in the agent.

HTTP API. JSON unless stated; errors are {"error": {"code": str, "message": str}} with status
400 (invalid_request, invalid_path), 404 (not_found, file_not_found, process_not_found),
413 (payload_too_large) or 500 (runtime_error).

  GET    /health               {"ok", "pid", "generation", "sandbox_id", "hostname", "time", "uptime_s"}
  GET    /stats                {"processes": user processes in /proc, atoll-init not counted}
  POST   /identity             {"sandbox_id": str, "generation": int, "hostname": str|null, "env": {..}|null,
                                "cpus": number|null, "workdir": str|null, "seed": str|null}
                               -> 200 {"sandbox_id", "generation", "hostname"}; sethostname failures ignored;
                               cpus narrows the CPU affinity commands inherit to ceil(cpus) CPUs;
                               workdir becomes the cwd of commands without one; writes
                               /run/atoll/identity.json (sandbox_id, generation, hostname, restored_at)
  POST   /exec                 {"cmd": str|[str], "cwd", "env", "timeout_s", "background", "user",
                                "stdin": str|null, "shell": "bash"|"sh"|null}
      str cmd runs as bash -l -c cmd when /bin/bash exists (shell null; ATOLL_AGENT_SHELL sets the
      default), else /bin/sh -c cmd (see `shells`); a list is the argv (a missing binary gives
      exit_code 127 and "<name>: command not found", a non-executable file 126). stdin is
      /dev/null, or a pipe fed `stdin` then closed. env is merged over
      the agent's environment (ATOLL_* removed, PATH and LANG=C.UTF-8 defaulted, HOME/USER/LOGNAME
      from the user's passwd entry). cwd defaults to the agent's cwd. Each command is a new session;
      on timeout the session, its process group, every descendant (by /proc ppid links) and every
      process of its cgroup (what left its session: setsid, orphans) get SIGKILL and the result has
      timed_out=true and exit_code 137. A command killed by signal N reports 128+N, like a shell.
      timeout_s covers what the command leaves running too: at its deadline atoll-init kills
      whatever is still in the command's cgroup (its deadlines), even after the call returned.
      * default: 200 {"exit_code", "stdout", "stderr", "duration_ms", "timed_out"}, output decoded as
        UTF-8 (errors replaced), each stream capped at 64 MiB (the head is kept, then
        "…[truncated N bytes]").
      * `Accept: application/x-ndjson`: a chunked stream of {"stdout": text} / {"stderr": text} lines
        as output arrives, then {"exit_code", "timed_out", "duration_ms"}. If the client goes away
        mid-stream the command's process tree is killed.
      * Once the command itself has exited, output is collected for 0.3 s more; a descendant that
        still holds the pipes (`cmd &` without redirection) is then left running, its further output
        is read and dropped, and the call returns.
      * background=true: 200 {"pid", "log_path"} at once; stdout and stderr are pipes read by a
        pump (procio) into the process's OutputLog (newest 4 MiB, by offset) and copied to
        /tmp/.atoll/proc-<pid>.log (removed with the record); stdin is a pipe the agent holds
        (or feeds `stdin` into, then closes). timeout_s still applies to it. A background command
        that cannot start is a 400.
  GET    /processes            {"items": [{"pid", "cmd", "running", "exit_code", "background",
                               "started_at", "log_path"}]}: background commands (finished ones stay
                               until deleted; the 1000 newest finished are kept) and running
                               foreground ones.
  DELETE /processes/<pid>      SIGKILL its session, group, descendants and cgroup; forget a background
                               record and its log -> 204; unknown pid -> 404 process_not_found
  GET    /processes/<pid>      its record (+ stdin_open, timed_out, output_bytes, and "signal": N when
                               a signal ended it, whoever sent it); 404 process_not_found
  GET    /processes/<pid>/output?offset=N&follow=1   chunked ndjson {"stdout"|"stderr": text, "offset"}
                               ({"dropped", "offset"} first when N is older than the log), then
                               {"exit_code", "timed_out", "duration_ms", "offset"[, "signal"]} once it exited;
                               a follower that hangs up leaves the process running
  POST   /processes/<pid>/stdin[?eof=1]   raw body written to its stdin -> {"written", "eof"};
                               409 stdin_closed / process_exited / invalid_state (not read for 30 s)
  POST   /processes/<pid>/signal  {"signal": "TERM"|"SIGTERM"|15} to its process group (via atoll-init)
  POST   /processes/<pid>/wait    {"timeout_s": n|null} -> its record once exited; 409 process_running
  POST   /processes/kill-all   every user process dies (atoll-init and its namespace) -> 204; the
                               worker's relief when the sandbox nears its host task limit
  PUT    /files?path=/abs[&mode=0644]   raw body (Content-Length or chunked), streamed to a temp
                               file in the same directory, then renamed over the path -> 204.
                               Parents are created. Mode defaults to the replaced file's (else 0644).
  GET    /files?path=/abs      200 application/octet-stream with Content-Length
  GET    /files/list?path=/dir {"items": [{"name", "path", "type": file|dir|symlink|other, "size",
                               "mode": permission bits as int, "mtime": unix float}]} sorted by name
  DELETE /files?path=/abs      unlink a file/symlink or remove a directory tree -> 204
  GET    /gate                 {"blockers": [str], "external_connections": int, "epoll_tcp_pids": [int]}
  POST   /gate/final           the gate, + "own_connections_open": int; the worker's last call before
                               a checkpoint: waits for its other connections' resets, answers with
                               Connection: close, and resets the connection once the worker shut down
      Blockers: non-loopback TCP connections in /proc/net/tcp{,6} that are not LISTEN and not the
      worker's own connections to the agent port (a TIME_WAIT on the agent port still counts: the
      worker cannot abort it); processes holding an epoll fd and a TCP socket (a socket whose inode
      is in no /proc/net table counts as TCP: conservative); or why /proc could not be read.
"""
