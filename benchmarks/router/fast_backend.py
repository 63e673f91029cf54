"""A fast fake engine for router benchmarks: HTTP/1.1 keep-alive on asyncio protocols (uvloop).

Answers every POST at once: a small JSON completion, or, when the body says "stream": true,
an SSE stream of `--chunks` events and [DONE] (chunked transfer encoding). GET /health and
other GETs get a tiny JSON. It parses only what a router sends, so it costs far less CPU per
request than any router in front of it: the benchmark measures the router, not this.
"""

from __future__ import annotations

import argparse
import asyncio
import json

COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "model": "bench",
        "choices": [{"index": 0, "text": "hello world", "finish_reason": "stop"}],
    }  # fmt: skip
).encode()
OK = b'{"status":"ok"}'


def sse_chunks(chunks: int) -> list[bytes]:
    """The SSE events of one answer, each framed as one HTTP chunk; the last ends the body."""
    event = b'data: {"choices":[{"index":0,"text":"tok","finish_reason":null}]}\n\n'
    parts = [event] * chunks + [b"data: [DONE]\n\n"]
    framed = [b"%x\r\n%s\r\n" % (len(p), p) for p in parts]
    framed[-1] += b"0\r\n\r\n"
    return framed


class Backend(asyncio.Protocol):
    def __init__(self, stream_chunks: list[bytes]) -> None:
        self.stream_chunks = stream_chunks
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].lower()
            length = 0
            marker = head.find(b"content-length:")
            if marker >= 0:
                length = int(
                    head[
                        marker + 15 : head.find(b"\r\n", marker)
                        if head.find(b"\r\n", marker) > 0
                        else None
                    ]
                )
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4 : head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length :]
            self.respond(head.startswith(b"post"), body)

    def respond(self, is_post: bool, body: bytes) -> None:
        if is_post and b'"stream":true' in body.replace(b" ", b""):
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            # One event per event-loop turn, as an engine sends one token per decode step.
            self.send_events(0)
            return
        payload = COMPLETION if is_post else OK
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(payload), payload)
        )

    def send_events(self, index: int) -> None:
        if self.transport.is_closing():
            return
        self.transport.write(self.stream_chunks[index])
        if index + 1 < len(self.stream_chunks):
            asyncio.get_running_loop().call_soon(self.send_events, index + 1)


async def serve(ports: list[int], chunks: int) -> None:
    loop = asyncio.get_running_loop()
    events = sse_chunks(chunks)
    servers = [
        await loop.create_server(lambda: Backend(events), "127.0.0.1", p, backlog=4096)
        for p in ports
    ]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ports", type=int, nargs="+", required=True)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args.ports, args.chunks))


if __name__ == "__main__":
    main()
