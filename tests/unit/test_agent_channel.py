"""The worker's channel to a guest agent: answers read whole are bounded."""

from __future__ import annotations

import pytest

from atoll.worker.runtimes import agent_channel


async def test_an_answer_read_whole_is_bounded():
    """The worker holds answers it reads whole (listings, process tables) up to a limit; past it the
    call fails with AnswerTooLarge (413 answer_too_large at the API), not a misleading 'no answer'."""

    async def body():
        for _ in range(5):
            yield b"x" * 1000

    r = agent_channel.Response(200, {}, body())
    with pytest.raises(agent_channel.AnswerTooLarge):
        await r.aread(limit=4000)
    r = agent_channel.Response(200, {}, body())
    assert len(await r.aread(limit=5000)) == 5000
