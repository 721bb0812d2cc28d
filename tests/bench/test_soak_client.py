"""The soak's client (bench.soak_client): what it retries on the other router and what it counts lost.

Two small real HTTP servers on loopback stand for the two routers: one resets each connection at
a chosen moment, the other streams an answer.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct

import httpx

from bench.soak_client import Outcome, one_request

STREAM = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
          b"x-kvscale-replica: r9\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
    writer.transport.abort()


async def _serve(handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    writer.write(STREAM + _chunk(b'data: {"choices": []}\n\n') + _chunk(b"data: [DONE]\n\n") + _chunk(b""))
    await writer.drain()
    writer.close()


async def _reset_before_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    _reset(writer)


async def _reset_after_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    writer.write(STREAM)
    await writer.drain()
    await asyncio.sleep(0.05)
    _reset(writer)


async def _one(first_router_handler) -> Outcome:
    failing, failing_url = await _serve(first_router_handler)
    answering, answering_url = await _serve(_answering)
    outcomes: list[Outcome] = []
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            # index 0: the first router tried is routers[0]
            await one_request(client, [failing_url, answering_url], 0, random.Random(1), outcomes)
    finally:
        failing.close()
        answering.close()
    return outcomes[0]


def test_a_reset_before_the_answer_is_retried_on_the_other_router() -> None:
    outcome = asyncio.run(_one(_reset_before_head))
    assert outcome.error is None
    assert outcome.router_retries == 1
    assert outcome.replica == "r9"
    assert outcome.done or outcome.hung_up


def test_a_reset_after_the_answer_began_is_counted_lost() -> None:
    outcome = asyncio.run(_one(_reset_after_head))
    assert outcome.router_retries == 0
    assert outcome.chunks == 0 and not outcome.done
    assert outcome.error is not None and outcome.error.startswith(("ReadError", "RemoteProtocolError"))
