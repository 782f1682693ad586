"""The resolver side of the egress gateway: the only DNS server a sandbox can reach.

nftables send every DNS question the sandbox asks, to any server, here. It answers A questions for
names the sandbox's policy could allow (core.netpolicy `may_resolve`), from gateway.names (hosts
files, then the worker's resolver); names the policy does not allow get REFUSED, names without an
address NXDOMAIN. Every other type (AAAA included: sandboxes have no IPv6) gets an empty answer and
is never forwarded. Called by gateway.egress (attach), over the sandbox's UDP socket.
"""

from __future__ import annotations

import asyncio
import logging
import typing

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from atoll.core import netpolicy
from atoll.gateway import fairshare
from atoll.gateway import names as names_mod


class Sandbox(typing.Protocol):
    """What the resolver reads of the sandbox it answers (gateway.egress's attachment)."""

    sid: str
    policy: netpolicy.Policy
    counters: typing.Any  # .dns_answered, .dns_refused
    bucket: fairshare.Bucket | None


log = logging.getLogger(__name__)
TTL = 30
MAX_INFLIGHT = 64
"""Questions of one sandbox waiting for the worker's resolver at once; more are dropped. Names the
hosts files or the cache know are answered at once, outside this bound."""


class Resolver(asyncio.DatagramProtocol):
    def __init__(self, att: Sandbox, names: names_mod.Names):
        self.att = att
        self.names = names
        self.transport: asyncio.DatagramTransport | None = None
        self._inflight = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        bucket = self.att.bucket
        if bucket is not None and bucket.tokens < 0:
            # over its share of the gateway's work: answered once the share allows (slowed, not
            # cut); a flood beyond the bound is dropped, as a busy resolver would
            self._later(self._after_debt(bucket, data, addr))
            return
        self._now(data, addr)

    def _now(self, data: bytes, addr: tuple[str, int]) -> None:
        with fairshare.Meter(self.att.bucket):
            answer = self._decide(data)
        if answer is None:
            return
        if isinstance(answer, tuple):  # a name nobody here knows yet: ask the worker's resolver
            self._later(self._resolve(*answer, addr))
            return
        self._send(answer, addr)

    def _later(self, coro: typing.Coroutine) -> None:
        if self._inflight >= MAX_INFLIGHT:
            coro.close()
            return  # a flood: dropped (the client retries)
        self._inflight += 1
        task = asyncio.ensure_future(coro)
        task.add_done_callback(self._done)

    async def _after_debt(self, bucket: fairshare.Bucket, data: bytes, addr: tuple[str, int]) -> None:
        await bucket.wait()
        with fairshare.Meter(bucket):
            answer = self._decide(data)
        if isinstance(answer, tuple):
            await self._resolve(*answer, addr)
        elif answer is not None:
            self._send(answer, addr)

    def _done(self, _task: asyncio.Future) -> None:
        self._inflight -= 1

    def _send(self, r: dns.message.Message, addr: tuple[str, int]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(r.to_wire(), addr)

    async def _resolve(self, r: dns.message.Message, question, name: str, addr: tuple[str, int]) -> None:
        try:
            self._answer_a(r, question, await self.names.resolve(name))
            self._send(r, addr)
        except Exception as e:  # noqa: BLE001 - a sandbox's packet must never make a traceback
            log.debug("dns: dropped a packet: %r", e, extra={"sandbox_id": self.att.sid})

    def _answer_a(self, r: dns.message.Message, question, addrs: frozenset[str]) -> None:
        if addrs:
            self.att.counters.dns_answered += 1
            r.answer.append(dns.rrset.from_text_list(question.name, TTL, "IN", "A", sorted(addrs)))
        else:
            r.set_rcode(dns.rcode.NXDOMAIN)

    def _decide(self, data: bytes):
        """The answer now (a message), None (dropped), or (response, question, name) when the
        name must be resolved first. Questions of names in a hosts file or the cache — nearly
        all — are answered at once, so a burst of them never waits behind the in-flight bound."""
        try:
            q = dns.message.from_wire(data)
        except (dns.exception.DNSException, ValueError):
            return None  # not DNS: dropped
        if q.flags & dns.flags.QR:
            return None  # a response, not a question: dropped
        r = dns.message.make_response(q)
        r.flags |= dns.flags.RA
        if len(q.question) != 1:
            r.set_rcode(dns.rcode.FORMERR)
            return r
        question = q.question[0]
        name = netpolicy.normalize_name(question.name.to_text(omit_final_dot=True))
        if name is None or not self.att.policy.may_resolve(name):
            self.att.counters.dns_refused += 1
            log.debug("dns refused: %r", question.name.to_text(), extra={"sandbox_id": self.att.sid})
            r.set_rcode(dns.rcode.REFUSED)
            return r
        if question.rdtype == dns.rdatatype.A and question.rdclass == dns.rdataclass.IN:
            known = self.names.known(name)
            if known is None:
                return r, question, name
            self._answer_a(r, question, known)
        return r  # any other type: NOERROR, no data (never forwarded)
