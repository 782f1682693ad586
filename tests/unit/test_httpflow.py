"""The egress gateway's parser and its rules, without sockets: gateway.httpflow (llhttp events),
gateway.placeholders (which secrets apply: the address rule, allow_http) and gateway.fairshare
(parse work per sandbox)."""

from __future__ import annotations

import time

import pytest

from atoll.gateway import fairshare, httpflow, placeholders


class Feed:
    """A stream that hands out prepared reads."""

    def __init__(self, *reads: bytes):
        self.reads = list(reads)

    async def read(self, n: int = 65536) -> bytes:
        return self.reads.pop(0) if self.reads else b""

    async def write(self, data: bytes) -> None:
        raise AssertionError("not written to")

    async def write_eof(self) -> None:
        pass

    def abort(self) -> None:
        pass


async def events(reader: httpflow.Reader) -> list:
    out = []
    while (ev := await reader.next()) is not None:
        out.append(ev)
    return out


async def test_a_thousand_one_byte_chunks_in_one_read_are_one_data_event():
    body = b"".join(b"1\r\n%c\r\n" % (65 + i % 26) for i in range(1000))
    req = b"POST /up HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"
    evs = await events(httpflow.Reader(Feed(req), response=False))
    assert [type(e).__name__ for e in evs] == ["Head", "Data", "End"]
    head, data = evs[0], evs[1]
    assert head.method == b"POST" and head.target == b"/up" and head.chunked and head.length is None
    assert len(data.data) == 1000 and data.data[:3] == b"ABC"
    framer = httpflow.Framer(head.chunked)
    assert framer.data(data.data) == b"3e8\r\n" + data.data + b"\r\n" and framer.end() == b"0\r\n\r\n"


async def test_heads_keep_case_order_and_repeats_and_encode_back_the_same():
    raw = b"GET /a?b=1 HTTP/1.1\r\nHost: a.test\r\nX-Mixed-Case: One\r\nx-mixed-case: Two\r\n\r\n"
    (head, end) = await events(httpflow.Reader(Feed(raw), response=False))
    assert head.headers == [(b"Host", b"a.test"), (b"X-Mixed-Case", b"One"), (b"x-mixed-case", b"Two")]
    assert httpflow.encode_head(head) == raw and isinstance(end, httpflow.End) and end.keep_alive


async def test_a_response_to_head_ends_with_its_head_despite_its_length():
    reader = httpflow.Reader(
        Feed(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n", b"HTTP/1.1 204 No Content\r\n\r\n"),
        response=True,
    )
    reader.head_only = True
    first = [await reader.next(), await reader.next()]
    assert first[0].status == 200 and first[0].length == 1234 and isinstance(first[1], httpflow.End)
    second = await events(reader)  # the next response is parsed normally
    assert second[0].status == 204 and isinstance(second[1], httpflow.End)


async def test_1xx_204_and_304_have_no_body_and_a_close_ends_an_unframed_body():
    reader = httpflow.Reader(
        Feed(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 304 Not Modified\r\nETag: x\r\n\r\n",
            b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of ",
            b"it",
        ),
        response=True,
    )
    evs = await events(reader)
    kinds = [type(e).__name__ for e in evs]
    assert kinds == ["Head", "End", "Head", "End", "Head", "Data", "Data", "End"], kinds
    assert [e.status for e in evs if isinstance(e, httpflow.Head)] == [100, 304, 200]
    assert httpflow.upstream_closes(evs[4], b"GET") and not evs[-1].keep_alive
    assert b"".join(e.data for e in evs if isinstance(e, httpflow.Data)) == b"all of it"


async def test_a_body_cut_short_is_an_error_not_an_end():
    reader = httpflow.Reader(Feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"), response=True)
    assert (await reader.next()).status == 200
    assert (await reader.next()).data == b"short"
    with pytest.raises(ConnectionResetError):
        await reader.next()


async def test_pipelined_requests_come_one_after_another():
    raw = b"GET /1 HTTP/1.1\r\nHost: a\r\n\r\nPOST /2 HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabcGET /3 HTTP/1.1\r\nHost: a\r\n\r\n"
    evs = await events(httpflow.Reader(Feed(raw), response=False))
    assert [e.target for e in evs if isinstance(e, httpflow.Head)] == [b"/1", b"/2", b"/3"]
    assert [e.data for e in evs if isinstance(e, httpflow.Data)] == [b"abc"]


@pytest.mark.parametrize(
    "raw, status, words",
    [
        (b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"a" * 70000 + b"\r\n\r\n", 431, "longer than"),
        (
            b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
            400,
            "both",
        ),
        (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: x\r\n\r\n", 400, "malformed"),
        (b"NOT HTTP AT ALL\r\n\r\n", 400, "malformed"),
    ],
)
async def test_bad_requests_get_the_answer_they_deserve(raw, status, words):
    reader = httpflow.Reader(Feed(raw[:30000], raw[30000:60000], raw[60000:]), response=False)
    with pytest.raises(httpflow.Malformed) as e:
        await events(reader)
    assert e.value.status == status and words in e.value.text


async def test_a_head_that_grows_slowly_is_cut_at_the_limit():
    parts = [b"GET / HTTP/1.1\r\nHost: a\r\nX-Long: "] + [b"a" * 4096] * 20
    with pytest.raises(httpflow.Malformed) as e:
        await events(httpflow.Reader(Feed(*parts), response=False))
    assert e.value.status == 431


async def test_an_upgrade_hands_over_the_bytes_behind_it():
    raw = b"GET /ws HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n\x81\x05hello"
    evs = await events(httpflow.Reader(Feed(raw), response=False))
    assert evs[0].upgrade and isinstance(evs[1], httpflow.End)
    assert isinstance(evs[2], httpflow.Switched) and evs[2].rest == b"\x81\x05hello"


# ---- the rule: which secrets apply ---------------------------------------------------------------
B_API = placeholders.Binding("atoll_ph_" + "a" * 32, "api-value", ("api.test",))
B_WILD = placeholders.Binding("atoll_ph_" + "b" * 32, "wild-value", ("*.test",), allow_http=True)
ADDRESSES = {"api.test": frozenset({"10.0.0.5"}), "x.test": frozenset({"10.0.0.6"})}


async def resolve(name: str) -> frozenset[str]:
    return ADDRESSES.get(name, frozenset())


async def test_a_secret_applies_only_at_an_address_its_host_resolves_to():
    ok = await placeholders.decide((B_API, B_WILD), "api.test", "10.0.0.5", plain=False, resolve=resolve)
    assert ok.apply == (B_API, B_WILD) and not ok.refused
    elsewhere = await placeholders.decide(
        (B_API, B_WILD), "api.test", "45.33.99.77", plain=False, resolve=resolve
    )
    assert not elsewhere.apply and elsewhere.refused == (B_API, B_WILD)
    assert "45.33.99.77 is not an address 'api.test' resolves to" in elsewhere.why
    nowhere = await placeholders.decide((B_API,), "unknown.test", "10.0.0.5", plain=False, resolve=resolve)
    assert nowhere == placeholders.NONE  # no binding for the name at all: nothing to refuse


async def test_plain_http_gets_only_secrets_that_allow_it():
    d = await placeholders.decide((B_API, B_WILD), "api.test", "10.0.0.5", plain=True, resolve=resolve)
    assert d.apply == (B_WILD,) and d.refused == (B_API,) and "allow_http" in d.why
    assert placeholders.carries(b"Bearer " + B_API.placeholder.encode(), d.refused)
    assert placeholders.substitute(b"k=" + B_WILD.placeholder.encode(), d.apply) == b"k=wild-value"


# ---- fair shares ---------------------------------------------------------------------------------
async def test_a_sandbox_over_its_share_waits_and_a_quiet_one_does_not():
    shares = fairshare.Shares(capacity=0.2)
    noisy, quiet = shares.bucket(), shares.bucket()
    noisy.charge(0.1)  # 50 ms over its burst
    t0 = time.monotonic()
    await quiet.wait()
    assert time.monotonic() - t0 < 0.01
    t0 = time.monotonic()
    await noisy.wait()
    waited = time.monotonic() - t0
    assert 0.2 <= waited <= 1.0 and noisy.waited > 0  # ~0.05 s of debt at 0.2/2 per second


def test_the_meter_charges_cpu_time_not_waiting_time():
    shares = fairshare.Shares()
    bucket = shares.bucket()
    with fairshare.Meter(bucket):
        time.sleep(0.05)  # asleep: no CPU used
    with fairshare.Meter(bucket):
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
    assert 0.015 <= bucket.spent < 0.04
