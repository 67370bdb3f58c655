"""What stands between the network and the routes, on rank 0: limits that hold whatever a client
sends, checked before any route parses a byte. What is not here: the routes (routes.py, tgi.py,
oairoutes.py) and request parsing (api.py, oai.py).

The connection (`GuardedH11`, uvicorn's h11 protocol with these additions):
- a connection with no request in progress is closed after `server.idle_timeout_s`, whether it
  never sent anything, sends its headers a byte at a time, or idles between requests;
- a request whose body has not all arrived `server.request_timeout_s` after its headers gets a
  408 and a close (a body sent a byte a second, or never);
- at `server.max_connections` open connections a new one closes the connection that has gone
  longest without a whole request (idle, or still sending one), so clients that never finish
  a request cannot hold the cap; only when every connection is at work does a new one get a
  503 and a close;
- a request line and headers over `server.max_header_bytes` get h11's 431/400 and a close;
- each close is counted by reason (`mpinfer_connections_closed_total{reason}`).

The request (`Guard`, an ASGI middleware):
- `server.api_key`: a bearer token on every route but /health (401), compared in constant time;
  "env:NAME" reads it from the environment variable NAME and "file:PATH" from a file (its
  first line), so the key need not appear in a command line (`ps`);
- the body: `server.max_body_bytes` whatever the transfer encoding: a Content-Length over it is
  refused before reading, a chunked body as soon as what arrived passes it (413); nothing
  larger is ever held;
- POST routes take `application/json` only (415): a browser page cannot send that to another
  origin without a CORS preflight, which this server never grants, so a drive-by request from
  any web page the user opens cannot reach the model;
- bound to loopback, the `Host` header must name this host (127.0.0.1, localhost, [::1], with
  or without the port) or one of `server.allowed_hosts` (421): a DNS-rebinding page, whose
  requests carry its own domain, gets nothing.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import time
from pathlib import Path

import h11
from fastapi import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..config import ServerConfig
from .api import ApiError

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]", "::1")


# POST routes that read no body (SageMaker's /ping): nothing a page could send reaches the model.
BODILESS = frozenset({"/ping"})


class BodyTooLarge(Exception):
    """A request body passed `server.max_body_bytes` while it was being read."""


def is_loopback_bind(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(cfg: ServerConfig) -> set[str] | None:
    """Host header values accepted (None: any, when not bound to loopback or told '*')."""
    extra = {h.strip().lower() for h in cfg.allowed_hosts.split(",") if h.strip()}
    if "*" in extra or not is_loopback_bind(cfg.host):
        return None
    names = set(LOOPBACK_NAMES) | extra
    return names | {f"{n}:{cfg.port}" for n in names}


def resolve_api_key(text: str) -> str:
    """server.api_key: the key itself, "env:NAME" (the environment variable NAME) or
    "file:PATH" (the file's first line); a ValueError naming what is missing."""
    if text.startswith("env:"):
        name = text[4:]
        if not os.environ.get(name):
            raise ValueError(f"server.api_key={text!r}: the environment variable {name} is "
                             "not set")  # fmt: skip
        return os.environ[name].strip()
    if text.startswith("file:"):
        path = Path(text[5:])
        try:
            key = path.read_text().splitlines()[0].strip() if path.stat().st_size else ""
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"server.api_key={text!r}: {path} cannot be read ({e})") from None
        if not key:
            raise ValueError(f"server.api_key={text!r}: {path} is empty")
        return key
    return text


class Guard:
    """The per-request checks above, as ASGI middleware; `reject(request, ApiError)` answers in
    the route family's error shape."""

    def __init__(self, app, *, cfg: ServerConfig, reject):
        self.app, self.cfg, self.reject = app, cfg, reject
        self.hosts = allowed_hosts(cfg)
        key = resolve_api_key(cfg.api_key)
        self.bearer = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        error = self.check(request)
        if error is not None:
            return await self.reject(request, error)(scope, receive, send)
        limit, seen = self.cfg.max_body_bytes, 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(f"request body is over the {limit} byte limit")
            return message

        await self.app(scope, limited, send)

    def check(self, request: Request) -> ApiError | None:
        cfg, headers = self.cfg, request.headers
        if self.hosts is not None and headers.get("host", "").lower() not in self.hosts:
            return ApiError(421, f"Host {headers.get('host', '')!r} is not this server (bound to "
                            f"{cfg.host}; server.allowed_hosts adds names)", field="host",
                            kind="misdirected")  # fmt: skip
        if self.bearer is not None and request.url.path != "/health":
            sent = headers.get("authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(sent, self.bearer):
                return ApiError(401, "missing or wrong bearer token", field="authorization",
                                kind="auth")  # fmt: skip
        size = headers.get("content-length", "")
        if size.isascii() and size.isdigit() and (len(size) > 18 or int(size) > cfg.max_body_bytes):
            return ApiError(413, f"request body of {size} bytes is over the "
                            f"{cfg.max_body_bytes} byte limit",
                            kind="payload_too_large")  # fmt: skip
        if request.method == "POST" and request.url.path not in BODILESS:
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json":
                return ApiError(415, f"Content-Type {media or 'missing'!r}: this route takes "
                                "application/json", field="content-type",
                                kind="unsupported_media_type")  # fmt: skip
        return None


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the connection limits above (`protocol_for` sets them from
    the server config, and the counter of closes the metrics read)."""

    idle_timeout_s = 10.0
    request_timeout_s = 30.0
    max_connections = 512
    closed: dict = {}  # reason -> connections closed for it (shared by every connection)
    CHECK_S = 0.5

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.phase, self.phase_since, self.timer = "idle", time.monotonic(), None
        if len(self.connections) > self.max_connections and not self.evict_one():
            body = b'{"error": "too many open connections", "error_type": "overloaded"}'
            self.close_for("over_cap", b"503 Service Unavailable", body)
            return
        self.timer = self.loop.call_later(self.CHECK_S, self.check)

    def current_phase(self) -> str:
        """idle (no request, or its headers still coming), receiving (headers in, the body
        not yet all here) or working (a whole request, its answer under way)."""
        if self.cycle is None or self.cycle.response_complete:
            return "idle"
        if self.conn.their_state is h11.SEND_BODY:
            return "receiving"
        return "working"

    def evict_one(self) -> bool:
        """At the cap: close the connection that has waited longest without a whole request."""
        waiting = [p for p in self.connections if p is not self and isinstance(p, GuardedH11)
                   and not p.transport.is_closing() and p.current_phase() != "working"]  # fmt: skip
        if not waiting:
            return False
        min(waiting, key=lambda p: p.phase_since).close_for("evicted")
        return True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.phase, self.phase_since = "idle", time.monotonic()

    def check(self) -> None:
        now, phase = time.monotonic(), self.current_phase()
        if phase != self.phase:
            self.phase, self.phase_since = phase, now
        waited = now - self.phase_since
        if phase == "idle" and waited >= self.idle_timeout_s:
            self.close_for("idle")
        elif phase == "receiving" and waited >= self.request_timeout_s:
            body = (b'{"error": "the request body did not arrive within server.request_timeout_s",'
                    b' "error_type": "timeout"}')  # fmt: skip
            self.close_for("slow_request", b"408 Request Timeout", body)
        else:
            self.timer = self.loop.call_later(self.CHECK_S, self.check)

    def close_for(self, reason: str, status: bytes = b"", body: bytes = b"") -> None:
        """Count the close, answer `status` first when given, and close the connection."""
        self.closed[reason] = self.closed.get(reason, 0) + 1
        if status and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                                 % (status, len(body), body))  # fmt: skip
        self.transport.close()

    def connection_lost(self, exc) -> None:
        if getattr(self, "timer", None) is not None:
            self.timer.cancel()
        super().connection_lost(exc)


def protocol_for(cfg: ServerConfig, closed: dict | None = None) -> type[GuardedH11]:
    """A GuardedH11 subclass carrying this server's limits and its counter of closes (uvicorn
    builds one per connection)."""
    return type("MpinferH11", (GuardedH11,), {
        "idle_timeout_s": cfg.idle_timeout_s, "request_timeout_s": cfg.request_timeout_s,
        "max_connections": cfg.max_connections, "closed": {} if closed is None else closed,
    })  # fmt: skip
