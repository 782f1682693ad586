"""E2B's control API in atoll's terms (atoll.e2b.control): create bodies of both SDK generations,
the network translation (E2B's allow wins, atoll's deny wins), the answers' required fields and
states, the list query's encodings, metrics, errors and access tokens."""

from __future__ import annotations

import datetime as dt
import urllib.parse

import pytest

from atoll.e2b import control as c


def test_a_2_63_create_with_nothing_given_lives_300_s_is_killed_at_its_end_and_reaches_the_internet():
    plan = c.create_request({"templateID": "base", "metadata": {}, "envVars": {}})
    assert plan == c.CreatePlan(
        {
            "template": "base",
            "metadata": {},
            "env": {},
            "timeout_s": 300,
            "idle_timeout_s": 0,  # E2B has no idle standby: standby is "paused" to the SDK
            "on_timeout": "delete",
            "e2b": {"auto_resume": False, "on_timeout": "kill"},  # kept as the sandbox's compat
            "network": {"allow_out": ["*"], "deny_out": []},
        },
        False,
    )
    assert c.create_request({}, internet=False).body["network"] == {"allow_out": [], "deny_out": []}


def test_a_2_31_create_with_everything():
    plan = c.create_request(
        {
            "templateID": "code-interpreter",
            "timeout": 60,
            "autoPause": True,
            "autoResume": {"enabled": True},
            "metadata": {"team": "a"},
            "envVars": {"A": "1"},
            "secure": True,
            "allow_internet_access": False,
            "volumeMounts": [{"name": "data", "path": "/data"}],
        }
    )
    assert plan.auto_resume is True
    assert plan.body == {
        "template": "code-interpreter-v1",
        "metadata": {"team": "a"},
        "env": {"A": "1"},
        "timeout_s": 60,
        "idle_timeout_s": 0,
        "on_timeout": "pause",
        "e2b": {"auto_resume": True, "on_timeout": "pause"},
        "network": {"allow_out": [], "deny_out": []},
        "drives": [{"name": "data", "path": "/data"}],
    }


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"timeout": 0}, "timeout 0 is out of range"),
        ({"timeout": "60"}, "whole number of seconds"),
        ({"timeout": 10**9}, "out of range"),
        ({"metadata": {"a": 1}}, "metadata['a'] must be a string"),
        ({"envVars": []}, "envVars must be a JSON object"),
        ({"autoPause": "yes"}, "autoPause must be true or false"),
        ({"mcp": {"x": {}}}, "mcp: the MCP gateway is not supported"),
        ({"network": {"rules": {"a.com": []}}}, "network.rules"),
        ({"network": {"egressProxy": "socks5://x"}}, "egress proxy"),
        ({"network": {"denyOut": ["evil.com"]}}, "not an IP address or CIDR"),
        ({"network": {"allowOut": "a.com"}}, "must be a list"),
        ({"network": {"surprise": 1}}, "unknown fields ['surprise']"),
        ({"volumeMounts": [{"name": "d"}]}, "needs a string name and path"),
        ([], "the request body must be a JSON object"),
    ],
)
def test_bad_create_bodies_are_400_naming_the_field(body, says):
    with pytest.raises(c.E2BError) as e:
        c.create_request(body)
    assert e.value.status == 400 and says in e.value.message, e.value.message


def test_e2bs_allow_wins_over_deny_in_atolls_deny_wins_policy():
    # deny everything but some: only those
    assert c.network_policy({"allowOut": ["1.1.1.1", "pypi.org"], "denyOut": ["0.0.0.0/0"]}, True) == {
        "allow_out": ["1.1.1.1", "pypi.org"],
        "deny_out": [],
    }
    # deny a network that holds an allowed address: the deny is dropped (E2B allows that address)
    assert c.network_policy({"allowOut": ["10.1.2.3"], "denyOut": ["10.0.0.0/8", "192.0.2.0/24"]}, True) == {
        "allow_out": ["*", "10.1.2.3"],
        "deny_out": ["192.0.2.0/24"],
    }
    assert c.network_policy({"allowOut": ["0.0.0.0/0"]}, False) == {"allow_out": ["*"], "deny_out": []}
    assert c.network_policy({"dnsServers": ["8.8.8.8"], "allowPublicTraffic": True}, False) == {
        "allow_out": [],
        "deny_out": [],
    }


SB = {
    "id": "sb-aaaaaaaaaaaaaaaa",
    "template": "base",
    "state": "standby",
    "created_at": "2026-12-06T18:00:00Z",
    "expires_at": None,
    "cpus": 1.5,
    "memory_mb": 512,
    "disk_mb": 1024,
    "metadata": {"team": "a"},
    "network": {"allow_out": ["*"], "deny_out": []},
    "on_timeout": "pause",
}


def test_answers_carry_every_field_the_sdks_require():
    s = c.sandbox(SB, token="tok")
    assert {"templateID", "sandboxID", "clientID", "envdVersion"} <= set(s) and s["envdAccessToken"] == "tok"
    listed = c.listed_sandbox(SB)
    assert listed["state"] == "paused" and listed["cpuCount"] == 2 and listed["endAt"].startswith("2126-")
    assert (
        c.listed_sandbox({**SB, "state": "creating", "expires_at": "2026-12-06T19:00:00Z"})["state"]
        == "running"
    )
    detail = c.sandbox_detail(
        {**SB, "compat": {"created_via": "e2b", "auto_resume": True, "on_timeout": "kill"}}, token="tok"
    )
    assert detail["lifecycle"] == {"autoResume": True, "onTimeout": "pause"} and detail["allowInternetAccess"]
    for key in (
        "templateID",
        "sandboxID",
        "clientID",
        "startedAt",
        "endAt",
        "cpuCount",
        "memoryMB",
        "diskSizeMB",
    ):
        assert key in detail


def test_the_list_query_of_both_sdks():
    # 2.63's paginator: urlencode({quote(k): quote(v)}) as one `metadata` parameter
    md = urllib.parse.urlencode({urllib.parse.quote("a b"): urllib.parse.quote("x&y=%"), "team": "a"})
    q = c.list_query({"metadata": md, "state": "paused", "order": "desc", "nextToken": "CUR", "limit": "5"})
    assert q == {
        "metadata.a b": "x&y=%",
        "metadata.team": "a",
        "state": "standby",
        "order": "desc",
        "cursor": "CUR",
        "limit": "5",
    }
    assert c.list_query({})["state"] == "running,creating,standby"
    assert c.list_query({"startedAfter": "2026-12-06T18:00:00Z"})["created_after"] == "2026-12-06T18:00:00Z"
    for bad in ({"state": "killed"}, {"order": "sideways"}):
        with pytest.raises(c.E2BError) as e:
            c.list_query(bad)
        assert e.value.status == 400


def test_metrics_errors_and_tokens():
    m = c.metrics(
        {
            "cpus": 2,
            "cpu_percent": 12.5,
            "memory_used_mb": 100,
            "memory_limit_mb": 512,
            "disk_used_mb": 1,
            "disk_limit_mb": 1024,
        },
        now=dt.datetime(2026, 12, 6, tzinfo=dt.UTC),
    )
    assert m == [
        {
            "timestamp": "2026-12-06T00:00:00Z",
            "timestampUnix": 1796515200,
            "cpuCount": 2,
            "cpuUsedPct": 12.5,
            "memUsed": 100 << 20,
            "memTotal": 512 << 20,
            "memCache": 0,
            "diskUsed": 1 << 20,
            "diskTotal": 1024 << 20,
        }
    ]
    assert c.error(404, "sandbox_not_found", "gone") == (
        404,
        {"code": 404, "message": "sandbox_not_found: gone"},
        {},
    )
    assert c.error(503, "no_worker", "full", retryable=True)[2] == {
        "Should-Retry": "true",
        "Retry-After": "1",
    }
    assert c.error(503, "worker_unavailable", "x", retryable=True, outcome_unknown=True)[2] == {
        "Should-Retry": "false"
    }
    key = b"k" * 32
    tok = c.access_token(key, SB["id"])
    assert c.check_access_token(key, SB["id"], tok)
    assert not c.check_access_token(key, "sb-bbbbbbbbbbbbbbbb", tok)
    assert not c.check_access_token(b"x" * 32, SB["id"], tok) and not c.check_access_token(
        key, SB["id"], None
    )
