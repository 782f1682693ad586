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
from atoll.gateway import names as names_mod

if typing.TYPE_CHECKING:
    from atoll.gateway.egress import _Attached

log = logging.getLogger(__name__)
TTL = 30
MAX_INFLIGHT = 64
"""Questions of one sandbox answered at once; more are dropped."""


class Resolver(asyncio.DatagramProtocol):
    def __init__(self, att: _Attached, names: names_mod.Names):
        self.att = att
        self.names = names
        self.transport: asyncio.DatagramTransport | None = None
        self._inflight = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._inflight >= MAX_INFLIGHT:
            return  # a flood: dropped, as a busy resolver would (the client retries)
        self._inflight += 1
        task = asyncio.ensure_future(self._answer(data, addr))
        task.add_done_callback(self._done)

    def _done(self, _task: asyncio.Future) -> None:
        self._inflight -= 1

    async def _answer(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            await self._answer_one(data, addr)
        except Exception as e:  # noqa: BLE001 - a sandbox's packet must never make a traceback
            log.debug("dns: dropped a packet: %r", e, extra={"sandbox_id": self.att.sid})

    async def _answer_one(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            q = dns.message.from_wire(data)
        except (dns.exception.DNSException, ValueError):
            return  # not DNS: dropped
        if q.flags & dns.flags.QR:
            return  # a response, not a question: dropped
        r = dns.message.make_response(q)
        r.flags |= dns.flags.RA
        if len(q.question) != 1:
            r.set_rcode(dns.rcode.FORMERR)
        else:
            question = q.question[0]
            name = netpolicy.normalize_name(question.name.to_text(omit_final_dot=True))
            if name is None or not self.att.policy.may_resolve(name):
                self.att.counters.dns_refused += 1
                log.debug("dns refused: %r", question.name.to_text(), extra={"sandbox_id": self.att.sid})
                r.set_rcode(dns.rcode.REFUSED)
            elif question.rdtype == dns.rdatatype.A and question.rdclass == dns.rdataclass.IN:
                addrs = await self.names.resolve(name)
                if addrs:
                    self.att.counters.dns_answered += 1
                    r.answer.append(dns.rrset.from_text_list(question.name, TTL, "IN", "A", sorted(addrs)))
                else:
                    r.set_rcode(dns.rcode.NXDOMAIN)
            # any other type: NOERROR, no data (never forwarded)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(r.to_wire(), addr)
