"""The egress policy's entries and decisions (core.netpolicy): what users write, what it allows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from atoll.core import errors, netpolicy

R = frozenset


def pol(allow=(), deny=()):
    return netpolicy.parse({"allow_out": list(allow), "deny_out": list(deny)})


@pytest.mark.parametrize(
    "raw, text, kind, port",
    [
        ("pypi.org", "pypi.org", "domain", None),
        ("PyPI.org.", "pypi.org", "domain", None),
        ("pypi.org:443", "pypi.org:443", "domain", 443),
        ("*.github.com", "*.github.com", "suffix", None),
        ("203.0.113.7", "203.0.113.7", "net", None),
        ("203.0.113.7/32:22", "203.0.113.7/32:22", "net", 22),
        ("10.0.0.0/8", "10.0.0.0/8", "net", None),
        ("*", "*", "any", None),
        ("*:443", "*:443", "any", 443),
    ],
)
def test_entries_users_write(raw, text, kind, port):
    e = netpolicy.parse_entry(raw)
    assert (e.text, e.kind, e.port) == (text, kind, port)


@pytest.mark.parametrize(
    "raw, says",
    [
        ("", "empty"),
        ("pypi.org:0", "port"),
        ("pypi.org:http", "port"),
        ("pypi.org:70000", "port"),
        ("pypi.org:\u00b2", "port"),  # found by validation: a superscript digit was a 500
        ("pypi.org:\u0663", "port"),
        ("b\u00fccher.de", "ASCII"),
        ("10.0.0.1/8", "IPv4"),  # host bits set: say what was meant
        ("300.1.1.1", "IPv4"),
        ("2001:db8::1", "IPv6"),
        ("[2001:db8::1]:443", "IPv6"),
        ("a*.github.com", "wildcard"),
        ("*.", "domain"),
        ("exa mple.com", "domain"),
        ("-bad.com", "domain"),
        (17, "string"),
    ],
)
def test_a_bad_entry_is_a_400_naming_it(raw, says):
    with pytest.raises(errors.InvalidRequest) as e:
        pol(allow=[raw])
    assert repr(raw) in e.value.message and says in e.value.message
    assert "pypi.org:443" in e.value.message  # and how to write one


def test_malformed_bodies_are_400():
    for body in ("pypi.org", ["pypi.org"], {"allow": []}, {"allow_out": "pypi.org"}):
        with pytest.raises(errors.InvalidRequest):
            netpolicy.parse(body)
    with pytest.raises(errors.InvalidRequest, match="at most"):
        pol(allow=[f"h{i}.example.com" for i in range(netpolicy.MAX_ENTRIES + 1)])
    assert netpolicy.parse(None) == netpolicy.DENY_ALL
    assert pol(allow=["a.com", "A.com", "a.com."]).to_wire() == {"allow_out": ["a.com"], "deny_out": []}


def test_default_is_deny():
    p = netpolicy.DENY_ALL
    assert not p.decide_address("93.184.216.34", 443).allowed
    assert not p.decide_name("example.com", "93.184.216.34", 443, R({"93.184.216.34"})).allowed
    assert not p.may_resolve("example.com")
    assert p.decide_address("1.1.1.1", 53).rule == "default deny"


def test_a_domain_is_matched_by_name_and_the_address_must_be_its_own():
    p = pol(allow=["pypi.org", "*.github.com:443"])
    ips = R({"151.101.0.223"})
    assert p.decide_name("pypi.org", "151.101.0.223", 80, ips).allowed
    # the allowed name sent to another address: refused, and the rule says why
    d = p.decide_name("pypi.org", "198.51.100.9", 443, ips)
    assert not d.allowed and "does not resolve to 198.51.100.9" in d.rule
    # a raw-IP connection needs an IP entry, even to the allowed domain's own address
    assert not p.decide_address("151.101.0.223", 443).allowed
    assert p.decide_name("api.github.com", "140.82.1.1", 443, R({"140.82.1.1"})).allowed
    assert not p.decide_name("api.github.com", "140.82.1.1", 80, R({"140.82.1.1"})).allowed  # port
    assert not p.decide_name("github.com", "140.82.1.1", 443, R({"140.82.1.1"})).allowed  # not below
    assert p.may_resolve("pypi.org") and p.may_resolve("x.y.github.com") and not p.may_resolve("evil.org")


def test_domains_reach_private_addresses_star_does_not():
    p = pol(allow=["*", "git.internal"])
    assert p.decide_address("93.184.216.34", 443).allowed
    for ip in ("10.1.2.3", "127.0.0.1", "169.254.169.254", "192.168.1.1", "100.64.0.1", "172.16.0.1"):
        assert not p.decide_address(ip, 443).allowed, ip
        assert not p.decide_name("anything.com", ip, 443, R({ip})).allowed, ip
    assert p.decide_name("git.internal", "10.1.2.3", 443, R({"10.1.2.3"})).allowed


def test_networks_and_ports():
    p = pol(allow=["10.20.0.0/16:5432", "203.0.113.7"])
    assert p.decide_address("10.20.3.4", 5432).allowed
    assert not p.decide_address("10.20.3.4", 5433).allowed
    assert not p.decide_address("10.21.0.1", 5432).allowed
    assert p.decide_address("203.0.113.7", 22).allowed and p.decide_address("203.0.113.7", 9).allowed


def test_deny_wins():
    p = pol(allow=["*", "*.example.com", "10.0.0.0/8"], deny=["bad.example.com", "10.9.0.0/16", "*:25"])
    ips = R({"93.184.216.34"})
    d = p.decide_name("bad.example.com", "93.184.216.34", 443, ips)
    assert not d.allowed and d.rule == "deny_out bad.example.com"
    assert p.decide_name("good.example.com", "93.184.216.34", 443, ips).allowed
    assert not p.decide_address("10.9.1.1", 80).allowed and p.decide_address("10.8.1.1", 80).allowed
    assert not p.decide_address("93.184.216.34", 25).allowed
    assert not p.may_resolve("bad.example.com") and p.may_resolve("good.example.com")


@given(st.text(max_size=40))
def test_any_text_parses_or_is_a_clear_400(raw):
    try:
        e = netpolicy.parse_entry(raw)
    except errors.InvalidRequest as err:
        assert "is not valid" in err.message
    else:
        assert netpolicy.parse_entry(e.text) == e  # the normalized form reads back the same
