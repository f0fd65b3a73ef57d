"""The bench client's HTTP/1.1 reader (`legato.bench.wire`): bodies framed every way a server may frame
them, cut at every byte, give the payload and nothing else; a connection is kept only after a clean end."""

from __future__ import annotations

import asyncio

import pytest

from legato.bench import wire

AUDIO = bytes(range(256)) * 3


def chunked(payload: bytes, sizes: list[int]) -> bytes:
    out, i = b"", 0
    for n in sizes:
        out += b"%x;ext=1\r\n" % n + payload[i:i + n] + b"\r\n"
        i += n
    return out + b"0\r\n\r\n"


RESPONSES = {
    "chunked": b"HTTP/1.1 200 OK\r\ncontent-type: audio/pcm\r\ntransfer-encoding: chunked\r\n\r\n"
               + chunked(AUDIO, [1, 300, 467]),
    "length": b"HTTP/1.1 200 OK\r\ncontent-type: audio/pcm\r\ncontent-length: %d\r\n\r\n" % len(AUDIO) + AUDIO,
    "close": b"HTTP/1.0 200 OK\r\ncontent-type: audio/pcm\r\n\r\n" + AUDIO,
}


async def _exchange(raw: bytes, piece: int) -> tuple[wire.Response, bool, bytes]:
    """Serves `raw` in pieces of `piece` bytes (a close-delimited one then closes) to one POST."""
    got = bytearray()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
        got.extend(head + await reader.readexactly(length))
        for i in range(0, len(raw), piece):
            writer.write(raw[i:i + piece])
            await writer.drain()
        if raw.startswith(b"HTTP/1.0"):
            writer.close()
        else:
            await reader.read()  # keep-alive: the client decides

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    conn = wire.Connection(f"http://127.0.0.1:{port}", {"Authorization": "Bearer k"})
    resp = wire.Response()
    resp.keep = True
    done = await conn.post("/v1/audio/speech", {"input": "hi"}, resp)
    await asyncio.wait_for(done, 10)
    conn.finish(resp, True)
    kept = conn._proto is not None
    conn.close()
    server.close()
    return resp, kept, bytes(got)


@pytest.mark.parametrize("framing", sorted(RESPONSES))
@pytest.mark.parametrize("piece", [1, 7, 4096])
def test_every_framing_cut_anywhere_gives_the_payload(framing, piece):
    resp, kept, sent = asyncio.run(_exchange(RESPONSES[framing], piece))
    assert resp.status == 200 and bytes(resp.body) == AUDIO and sum(resp.sizes) == len(AUDIO)
    assert len(resp.times) == len(resp.sizes) and resp.end is not None and resp.end >= resp.times[-1]
    assert kept == (framing != "close")  # HTTP/1.0 and close-delimited bodies end their connection
    assert sent.startswith(b"POST /v1/audio/speech HTTP/1.1\r\n") and b"Authorization: Bearer k\r\n" in sent
    assert sent.endswith(b'{"input": "hi"}')


def test_a_refused_connection_is_a_transport_error():
    async def go():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        await wire.Connection(f"http://127.0.0.1:{port}").post("/x", {}, wire.Response())

    with pytest.raises(wire.TransportError):
        asyncio.run(go())
