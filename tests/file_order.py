"""The order `make test` hands test files to its processes: longest first.

`make test` runs files on TEST_PROCS processes with pytest-xdist's `--dist loadfile`: each process
takes a whole file, and the next one when it is nearly done. Left to itself xdist hands out the
files with the most tests first (`--loadscope-reorder`), which puts the many fast unit-test files
first and the integration files of one or two long tests (a private cluster, a SeaweedFS, a build
past its time limit) last, where one of them keeps a process busy for a minute after the others
ran out of work. Handing out the longest files first (longest-processing-time-first, the classic
rule for spreading jobs over machines) ends the run with short files instead.

ESTIMATE_S holds each file's tests' time in all (setup, call and teardown summed: the `time` of
its testcases in `--junitxml`), in seconds, the mean of two `make test` runs on the 2-core machine
(2026-12-07, four and five processes), for the files of a second or more, longest first. Only
their order matters and only roughly: re-measure when a file grows or shrinks a lot (the
`--junitxml` of a run, summed per file). A file not listed (a new one) is ranked at UNLISTED_S by
its folder, and otherwise comes last, in collection order (the many short unit files fill the end
of the run). tests/conftest.py turns this on with ATOLL_TEST_ORDER=longest, and only when
pytest-xdist runs with `--dist loadfile` (a single process keeps pytest's own order), and turns off
xdist's reordering by test count, which would undo it. It is off by default: its one fresh-clone
CI run (2026-12-07) took 16 min 35 s, and the next run without it, on the same tests, 16 min 37 s:
the order did not change the wall time here, so `make test` keeps xdist's own.
"""

from __future__ import annotations

import pytest

ESTIMATE_S: dict[str, float] = {
    "tests/integration/test_split.py": 215,
    "tests/integration/test_templates.py": 190,
    "tests/integration/test_archive.py": 177,
    "tests/integration/test_restart.py": 153,
    "tests/component/test_openapi.py": 120,
    "tests/integration/test_edge.py": 99,
    "tests/security/test_host_hardening.py": 97,
    "tests/integration/test_secrets_previews.py": 93,
    "tests/integration/test_standby.py": 84,
    "tests/integration/test_drain.py": 76,
    "tests/integration/test_openapi_live.py": 76,
    "tests/component/test_worker_protocol.py": 67,
    "tests/component/test_leases.py": 66,
    "tests/security/test_agent_isolation.py": 62,
    "tests/integration/test_build_limits.py": 49,
    "tests/integration/test_processes.py": 48,
    "tests/integration/test_egress.py": 47,
    "tests/integration/test_pty.py": 44,
    "tests/integration/test_metering.py": 44,
    "tests/integration/test_e2b_sdk.py": 43,
    "tests/component/test_lost_workers.py": 43,
    "tests/integration/test_files_api.py": 43,
    "tests/component/test_state_machine.py": 41,
    "tests/integration/test_sandbox_ca.py": 39,
    "tests/integration/test_lifetime.py": 39,
    "tests/integration/test_lost_worker.py": 38,
    "tests/integration/test_filer_drives.py": 35,
    "tests/component/test_databases.py": 34,
    "tests/integration/test_build_fetch.py": 33,
    "tests/component/test_audit.py": 32,
    "tests/integration/test_sandboxes.py": 31,
    "tests/integration/test_restore_faults.py": 31,
    "tests/component/test_paging.py": 27,
    "tests/integration/test_mcp.py": 26,
    "tests/e2e/test_sdk_cli.py": 25,
    "tests/integration/test_snapshots.py": 25,
    "tests/integration/test_adopt.py": 24,
    "tests/component/test_edge_seam.py": 24,
    "tests/component/test_drain.py": 24,
    "tests/security/test_tenant_traffic.py": 23,
    "tests/integration/test_output_limits.py": 23,
    "tests/integration/test_resume_failures.py": 21,
    "tests/integration/test_servers.py": 21,
    "tests/integration/test_compat.py": 20,
    "tests/component/test_metering.py": 20,
    "tests/component/test_templates.py": 18,
    "tests/unit/test_guest_agent.py": 17,
    "tests/integration/test_postgres_records.py": 17,
    "tests/integration/test_worker_tls.py": 16,
    "tests/component/test_control_plane.py": 16,
    "tests/component/test_e2b_app.py": 15,
    "tests/component/test_shared_records.py": 14,
    "tests/component/test_edge.py": 14,
    "tests/integration/test_cli_progress.py": 14,
    "tests/component/test_archive_gc.py": 13,
    "tests/component/test_archive_format.py": 13,
    "tests/security/test_sandbox_boundary.py": 13,
    "tests/integration/test_default_pool.py": 12,
    "tests/component/test_build_fetch.py": 12,
    "tests/component/test_lifetime.py": 12,
    "tests/security/test_worker_key.py": 12,
    "tests/integration/test_split_routes.py": 12,
    "tests/unit/test_cli_coercion.py": 12,
    "tests/component/test_reconciliation.py": 11,
    "tests/integration/test_volumes.py": 11,
    "tests/component/test_worker_impostors.py": 11,
    "tests/component/test_client_tls.py": 11,
    "tests/component/test_quotas.py": 10,
    "tests/integration/test_bad_input.py": 10,
    "tests/integration/test_checkpoint_failures.py": 10,
    "tests/component/test_slots.py": 10,
    "tests/component/test_objectstore.py": 9,
    "tests/component/test_stores.py": 9,
    "tests/unit/test_pressure.py": 9,
    "tests/unit/test_agent_pack.py": 9,
    "tests/component/test_snapshots.py": 8,
    "tests/component/test_pty.py": 8,
    "tests/component/test_move_archived.py": 8,
    "tests/component/test_watch.py": 8,
    "tests/unit/test_agent_processes.py": 8,
    "tests/component/test_archive_tier.py": 8,
    "tests/unit/test_lifecycle.py": 7,
    "tests/integration/test_cpus.py": 7,
    "tests/unit/test_kubernetes_manifests.py": 7,
    "tests/component/test_tenants.py": 7,
    "tests/security/test_revocation.py": 7,
    "tests/component/test_e2b_volumes.py": 7,
    "tests/component/test_default_pool.py": 6,
    "tests/integration/test_errors.py": 6,
    "tests/unit/test_tunnel.py": 6,
    "tests/component/test_database_restart.py": 6,
    "tests/component/test_fileops.py": 6,
    "tests/component/test_idempotency.py": 6,
    "tests/integration/test_login_profile.py": 5,
    "tests/component/test_e2b_envd_files.py": 5,
    "tests/unit/test_runtime_key.py": 5,
    "tests/component/test_tenant_isolation.py": 4,
    "tests/component/test_docs_pages.py": 4,
    "tests/unit/test_seam.py": 4,
    "tests/component/test_e2b_envd_process.py": 4,
    "tests/security/test_scopes.py": 4,
    "tests/component/test_bad_input.py": 4,
    "tests/unit/test_cli_polish.py": 4,
    "tests/integration/test_up_grants.py": 4,
    "tests/unit/test_cli.py": 4,
    "tests/unit/test_worker_home.py": 3,
    "tests/component/test_mcp.py": 3,
    "tests/unit/test_sdk.py": 3,
    "tests/unit/test_agent_fileops.py": 2,
    "tests/unit/test_atoll_init.py": 2,
    "tests/security/test_key_checks.py": 2,
    "tests/unit/test_mcp_server.py": 2,
    "tests/unit/test_db.py": 2,
    "tests/component/test_drive_tokens.py": 2,
    "tests/unit/test_ipc.py": 2,
    "tests/integration/test_disconnect.py": 2,
    "tests/unit/test_stores.py": 2,
    "tests/unit/test_sniff.py": 1,
    "tests/unit/test_retained.py": 1,
    "tests/unit/test_agent_channel.py": 1,
    "tests/security/test_tenant_references.py": 1,
    "tests/unit/test_agent_tarfile_import.py": 1,
    "tests/component/test_ui_pages.py": 1,
    "tests/unit/test_http11.py": 1,
    "tests/unit/test_templates.py": 1,
    "tests/unit/test_cli_tenants.py": 1,
}

# A file not in ESTIMATE_S under these folders (a new one) starts real installations: put it in the
# middle rather than behind the short unit files.
UNLISTED_S = {"tests/integration/": 20.0, "tests/security/": 20.0, "tests/e2e/": 20.0}


def rank(path: str) -> float:
    """The sort key of a file (its path relative to the repository): longest first, unknown last."""
    if path in ESTIMATE_S:
        return -ESTIMATE_S[path]
    return -next((s for folder, s in UNLISTED_S.items() if path.startswith(folder)), 0.0)


class LongestFirst:
    """Orders the collected items file by file, longest file first (ESTIMATE_S), keeping the order
    of the items within each file and of the files not listed. Registered in each xdist worker
    (which collects; the controller hands out the files in the order the workers collected them)."""

    @pytest.hookimpl(trylast=True)  # after pytest's own reordering (it groups parametrized fixtures)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        # a stable sort; the path keeps the items of files of equal estimates apart
        items.sort(key=lambda item: (rank(path := item.nodeid.split("::", 1)[0]), path))


class _Controller:
    """In the xdist controller: tells each worker to order its collection (xdist sets a worker's
    own `dist` option to "no", so the worker cannot see the mode itself)."""

    def pytest_configure_node(self, node) -> None:
        node.workerinput[_FLAG] = True


_FLAG = "atoll_longest_file_first"


def configure(config: pytest.Config) -> None:
    """From tests/conftest.py's pytest_configure: in the controller of a `--dist loadfile` run,
    turn off xdist's reordering by test count and flag the workers; in a flagged worker, order."""
    if getattr(config, "workerinput", {}).get(_FLAG):
        config.pluginmanager.register(LongestFirst(), "atoll-longest-file-first")
    elif getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False
        config.pluginmanager.register(_Controller(), "atoll-longest-file-first-controller")
