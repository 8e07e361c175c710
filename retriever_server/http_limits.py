"""What uvicorn leaves unbounded on a connection: the bytes of a request's headers and the time they take to arrive.

uvicorn's httptools protocol holds a request's headers in memory whatever their size (a 1 MiB header and 5,000
headers were answered 200; 100 unfinished 4 MiB headers held 400 MiB) and waits for them for ever (stalled
connections stayed open 75 s and more: keep-alive's timeout only starts after a response). :func:`bounded_protocol`
is the same protocol with both bounded: more than ``max_header_bytes`` before the blank line that ends the headers is
a 431, headers not complete ``header_timeout_s`` after the connection opened or the last response was sent is a 408,
each with a JSON ``detail`` naming the limit, and the connection is closed. The body is bounded by the server
(``max_body_bytes``).
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

HEADERS_END = b"\r\n\r\n"


class _BoundedProtocol(HttpToolsProtocol):
    max_header_bytes: int
    header_timeout_s: float

    # Bytes are counted from the end of one request (or the connection's start) to the blank line ending the next
    # one's headers; never in a body, which may still be arriving after an early answer (a 429 sent unread).

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._message_done = True
        self._count_headers()
        self._start_clock()

    def _count_headers(self) -> None:
        self._counting, self._header_bytes, self._tail = True, 0, b""

    def _start_clock(self) -> None:
        """The next request's headers are due within header_timeout_s."""
        self._stop_clock()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _stop_clock(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        if self._counting:
            seen = self._tail + data
            end = seen.find(HEADERS_END)
            self._header_bytes += (end + len(HEADERS_END) - len(self._tail)) if end >= 0 else len(data)
            self._tail = seen[-(len(HEADERS_END) - 1):]
            if self._header_bytes > self.max_header_bytes:
                self._refuse(431, f"headers: more than max_header_bytes={self.max_header_bytes} bytes")
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._message_done = False

    def on_headers_complete(self) -> None:
        self._counting = False
        self._stop_clock()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._message_done = True
        self._count_headers()
        if self.cycle is not None and self.cycle.response_complete:  # answered before its body was read
            self._start_clock()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._message_done and not self.transport.is_closing():
            self._start_clock()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self._refuse(408, f"headers: not complete within header_timeout_s={self.header_timeout_s:g}")

    def _refuse(self, status: int, detail: str) -> None:
        self._stop_clock()
        body = json.dumps({"detail": detail}).encode()
        self.transport.write(STATUS_LINE[status] + b"content-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.transport.close()


def bounded_protocol(max_header_bytes: int, header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with these limits, for ``uvicorn.run(..., http=...)``."""
    if max_header_bytes < 1024 or header_timeout_s <= 0:
        raise ValueError(f"expected max_header_bytes >= 1024 and header_timeout_s > 0, got {max_header_bytes} and "
                         f"{header_timeout_s}")
    return type("BoundedHttpProtocol", (_BoundedProtocol,),
                {"max_header_bytes": max_header_bytes, "header_timeout_s": header_timeout_s})
