"""An HTTP proxy on 127.0.0.1 that puts an S3 server's faults on the wire, for soaks and tests.

Clients (an ``S3Tier``'s aiobotocore client) talk plain HTTP/1.1 to the proxy as if it were
the server; the proxy forwards each request to the real server (SeaweedFS) and relays the
answer, except for a seeded share of requests, which get one fault each, counted by kind:

- ``delay``: forwarded after a pause (up to ``max_delay``);
- ``reset``: the connection is reset (RST) without an answer;
- ``drop``: the request is swallowed; the connection is held silent, then reset;
- ``error_500``: an S3 ``InternalError`` answer;
- ``slow_down_503``: an S3 ``SlowDown`` answer;
- ``truncate``: the real answer's head with only part of its body, then a reset.

It parses only what it must to frame messages (the request line, ``Content-Length``,
``Transfer-Encoding: chunked``, ``Expect: 100-continue``); bodies pass through untouched.
``FaultProxy.enabled`` turns the faults off and on at run time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import random
import socket
import struct

__all__ = ["FAULT_KINDS", "FaultProxy"]

HOST = "127.0.0.1"
FAULT_KINDS = ("delay", "reset", "drop", "error_500", "slow_down_503", "truncate")
_MAX_HEAD = 64 << 10
_ERRORS = {
    "error_500": (
        500,
        "Internal Server Error",
        "InternalError",
        "We encountered an internal error.",
    ),
    "slow_down_503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
}


class _Message:
    """One HTTP message's head, split into its first line and its headers."""

    def __init__(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        self.first = lines[0]
        self.headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                self.headers.append((name.strip(), value.strip()))

    def get(self, name: str) -> str | None:
        lower = name.lower()
        for key, value in self.headers:
            if key.lower() == lower:
                return value
        return None

    def drop(self, name: str) -> None:
        lower = name.lower()
        self.headers = [(k, v) for k, v in self.headers if k.lower() != lower]

    def encode(self) -> bytes:
        lines = [self.first, *(f"{k}: {v}" for k, v in self.headers), "", ""]
        return "\r\n".join(lines).encode("latin-1")

    @property
    def closes(self) -> bool:
        return (self.get("Connection") or "").lower() == "close"


async def _read_body(reader: asyncio.StreamReader, message: _Message, *, bodiless: bool) -> bytes:
    """The raw body bytes after ``message`` (chunked bodies with their framing)."""
    if bodiless:
        return b""
    if (message.get("Transfer-Encoding") or "").lower() == "chunked":
        parts = []
        while True:
            line = await reader.readuntil(b"\r\n")
            parts.append(line)
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, up to the empty line
                    trailer = await reader.readuntil(b"\r\n")
                    parts.append(trailer)
                    if trailer == b"\r\n":
                        return b"".join(parts)
            parts.append(await reader.readexactly(size + 2))
    length = message.get("Content-Length")
    if length is not None:
        return await reader.readexactly(int(length))
    return b""


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST, as a crashed server or a middlebox would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """Listens on a free 127.0.0.1 port (``port``) and forwards to ``upstream_port``."""

    def __init__(
        self,
        upstream_port: int,
        *,
        seed: int,
        share: float,
        kinds: tuple[str, ...] = FAULT_KINDS,
        max_delay: float = 0.4,
        drop_hold: float = 3.0,
        upstream_host: str = HOST,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.share = share
        self.kinds = kinds
        self.max_delay = max_delay
        self.drop_hold = drop_hold
        self.enabled = True
        self.requests = 0
        self.faults: collections.Counter[str] = collections.Counter()
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _pick(self) -> str | None:
        self.requests += 1
        if not self.enabled or self._rng.random() >= self.share:
            return None
        kind = self._rng.choice(self.kinds)
        self.faults[kind] += 1
        return kind

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    return
                request = _Message(head)
                method = request.first.split(" ", 1)[0].upper()
                if (request.get("Expect") or "").lower() == "100-continue":
                    request.drop("Expect")
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = await _read_body(reader, request, bodiless=False)
                fault = self._pick()
                if fault == "reset":
                    _reset(writer)
                    return
                if fault == "drop":
                    await asyncio.sleep(self.drop_hold)
                    _reset(writer)
                    return
                if fault in _ERRORS:
                    writer.write(_error(fault, method))
                    await writer.drain()
                    continue
                if fault == "delay":
                    await asyncio.sleep(self._rng.uniform(0.0, self.max_delay))
                if upstream is None:
                    upstream = await asyncio.open_connection(*self.upstream)
                up_reader, up_writer = upstream
                up_writer.write(request.encode() + body)
                await up_writer.drain()
                answer_head = await up_reader.readuntil(b"\r\n\r\n")
                answer = _Message(answer_head)
                status = int(answer.first.split(" ")[1])
                bodiless = method == "HEAD" or status in (204, 304) or status < 200
                answer_body = await _read_body(up_reader, answer, bodiless=bodiless)
                if fault == "truncate" and len(answer_body) > 1:
                    writer.write(answer_head + answer_body[: len(answer_body) // 2])
                    await writer.drain()
                    _reset(writer)
                    return
                writer.write(answer_head + answer_body)
                await writer.drain()
                if answer.closes or request.closes:
                    return
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            return
        except asyncio.CancelledError:
            if self._server is None or not self._server.is_serving():
                return  # closing: this connection's task ends here, not in asyncio's callback
            raise
        finally:
            self._tasks.discard(task)
            if upstream is not None:
                upstream[1].transport.abort()
            writer.transport.abort()


def _error(kind: str, method: str) -> bytes:
    status, phrase, code, message = _ERRORS[kind]
    body = (
        b""
        if method == "HEAD"
        else (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
        ).encode()
    )
    length = len(body)
    head = (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()
    return head + body


async def _main(args: argparse.Namespace) -> None:
    async with FaultProxy(args.upstream_port, seed=args.seed, share=args.share) as proxy:
        print(proxy.endpoint_url, flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("upstream_port", type=int, help="the S3 server's port on 127.0.0.1")
    parser.add_argument("--share", type=float, default=0.05, help="share of requests faulted")
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(_main(parser.parse_args()))
