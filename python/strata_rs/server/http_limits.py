"""The request head's bounds: uvicorn's httptools protocol with a limit on the head's bytes and
on its header count.

llhttp (the parser under httptools) has no limit of its own, and uvicorn's protocol keeps the URL
and every header it is sent: one connection could hold hundreds of MiB before any route (or the
API key check) runs. h11's default bound is 16 KiB, nginx's 8 KiB per line. A head over the limit
is answered 431 with the API's JSON error and the connection closed, before it is buffered.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

logger = logging.getLogger("strata_rs.server")

# The request line and the header lines, with their line ends, up to the blank line.
MAX_HEAD_BYTES = 16 * 1024
MAX_HEADERS = 100

HEAD_END = b"\r\n\r\n"


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that answers 431 to a request head over `MAX_HEAD_BYTES` bytes or with
    more than `MAX_HEADERS` headers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # the bytes arriving belong to a request head
        self._head_bytes = 0
        self._tail = b""  # the head's last bytes: its end can straddle two reads
        self._rejected = False

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        if self._in_head:
            window = self._tail + data
            end = window.find(HEAD_END)
            if end >= 0:
                self._head_bytes += end + len(HEAD_END) - len(self._tail)
                self._in_head = False
            else:
                self._head_bytes += len(data)
                self._tail = window[-(len(HEAD_END) - 1) :]
            if self._head_bytes > MAX_HEAD_BYTES:
                self._reject(f"the request head is over the limit of {MAX_HEAD_BYTES} bytes")
                return
        super().data_received(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._rejected:
            return
        super().on_header(name, value)
        if len(self.headers) > MAX_HEADERS:
            self._reject(f"the request has more than {MAX_HEADERS} headers")

    def on_headers_complete(self) -> None:
        if not self._rejected:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._rejected:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._rejected:
            return
        super().on_message_complete()
        # A kept-alive connection's next request starts its own head.
        self._in_head = True
        self._head_bytes = 0
        self._tail = b""

    def _reject(self, message: str) -> None:
        self._rejected = True
        logger.info("request head 431 invalid_request_error: %s", message)
        body = json.dumps(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_header_fields_too_large",
                }
            }
        ).encode()
        head = [STATUS_LINE[431]]
        for name, value in self.server_state.default_headers:
            head.append(name + b": " + value + b"\r\n")
        head += [
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
            b"connection: close\r\n",
            b"\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
