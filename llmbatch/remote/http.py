"""The HTTP transport to an OpenAI-compatible endpoint, and how its answers are classed.

aiohttp with msgspec's JSON codec (both come with vLLM): measured against httpx and
the official ``openai`` client in ``benchmarks/remote_vs_client.py`` (CPU time per
request is what bounds one worker's request rate; see docs/guides/remote-endpoints.md).

The key goes only into the ``Authorization`` header of each request; no message this
module builds contains it (a server that echoes it back is cut out of messages too).
"""

from __future__ import annotations

import email.utils
import enum
import random
import re
import socket
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from llmbatch.contract.states import EndpointFault, ErrorClass

# A server's message kept in a dead letter or a log line: enough to see why, never a row.
MESSAGE_CHARS = 300
# Of a 2xx body that is not JSON, the start shown (enough to tell an HTML page).
BODY_START_CHARS = 60
# Full-jitter backoff (sleep a uniform time in [0, min(cap, base * 2**attempt)]).
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 10.0

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class Verdict(enum.StrEnum):
    """What a response means for its item, its job and its worker."""

    OK = "ok"
    ITEM_DEAD = "item_dead"  # the request itself is bad: dead-letter the item
    RETRY = "retry"  # 5xx, timeouts, dropped connections, unusable 2xx: send again later
    THROTTLED = "throttled"  # 429/503: retry, and slow the whole endpoint down
    REFUSED = "refused"  # 401/403, a model the endpoint does not serve: stop the job


@dataclass(slots=True)
class Answer:
    verdict: Verdict
    status: int
    body: Any = None
    message: str = ""
    error_class: ErrorClass | None = None
    retry_after_s: float | None = None
    # The endpoint's doing (THROTTLED, RETRY and REFUSED answers): for status and pauses.
    fault: EndpointFault | None = None


def unusable(status: int, message: str) -> Answer:
    """A 2xx that is not an answer (sent again, and counted: it may be paid for)."""
    return Answer(
        Verdict.RETRY,
        status,
        message=f"HTTP {status} but {message}",
        fault=EndpointFault.UNUSABLE_ANSWER,
    )


class Transport:
    """One connection pool to one endpoint, shared by every request of the worker."""

    def __init__(
        self, base_url: str, *, api_key: str | None, timeout_s: float, max_connections: int
    ) -> None:
        self._base = base_url.rstrip("/")
        self._secret = api_key or ""
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(10.0, timeout_s))
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self.in_flight = 0
        self._retired = False

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, ttl_dns_cache=300),
                headers=self._headers,
                timeout=self._timeout,
                json_serialize=lambda o: _encode(o).decode(),
                # No cookies: an endpoint's session cookie must not leak between jobs.
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def post(self, path: str, payload: Mapping[str, Any]) -> Answer:
        """POST ``payload`` to ``base_url + path`` and class the answer; transport
        failures (timeouts, refused or dropped connections) are ``RETRY``."""
        self.in_flight += 1
        try:
            async with self._open().post(self._base + path, data=_encode(payload)) as response:
                raw = await response.read()
                return classify(response.status, response.headers, raw, secret=self._secret)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            fault, message = transport_fault(exc, timeout_s=self._timeout_s)
            return Answer(Verdict.RETRY, 0, message=self.scrub(message), fault=fault)
        finally:
            self.in_flight -= 1
            if self._retired and not self.in_flight:
                await self.close()

    async def get(self, path: str) -> Answer:
        try:
            async with self._open().get(self._base + path) as response:
                raw = await response.read()
                return classify(response.status, response.headers, raw, secret=self._secret)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            fault, message = transport_fault(exc, timeout_s=self._timeout_s)
            return Answer(Verdict.RETRY, 0, message=self.scrub(message), fault=fault)

    async def retire(self) -> None:
        """Replaced (the endpoint's options changed): close once the requests in flight
        on it have come back, so none is cut off."""
        self._retired = True
        if not self.in_flight:
            await self.close()

    def scrub(self, text: str) -> str:
        return scrub(text, self._secret)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def scrub(text: str, secret: str) -> str:
    """``text`` without ``secret`` (a server may echo the key back), cut short."""
    if secret:
        text = text.replace(secret, "[key]")
    text = " ".join(text.split())
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 1] + "…"


_CONTEXT_WORDS = re.compile(
    r"maximum context length|context length|context_length_exceeded|maximum model length"
    r"|too many tokens|prompt is too long|input tokens exceed",
    re.IGNORECASE,
)
_MODEL_MISSING = re.compile(r"model.*(does not exist|not found|not served)|model_not_found", re.I)


def classify(status: int, headers: Mapping[str, str], raw: bytes, *, secret: str) -> Answer:
    """What an HTTP answer means (see :class:`Verdict`)."""
    if 200 <= status < 300:
        try:
            return Answer(Verdict.OK, status, body=_decode(raw))
        except msgspec.DecodeError:
            start = scrub(raw[:BODY_START_CHARS].decode(errors="replace"), secret)
            return unusable(status, f"the body is not JSON: {start!r}")
    message = scrub(_error_message(raw) or f"HTTP {status}", secret)
    message = f"HTTP {status}: {message}"
    if status == 429 or status == 503:
        return Answer(
            Verdict.THROTTLED,
            status,
            message=message,
            retry_after_s=retry_after(headers),
            fault=EndpointFault.THROTTLED,
        )
    if status in (401, 403):
        return Answer(Verdict.REFUSED, status, message=message, fault=EndpointFault.REFUSED)
    if status == 404 and _MODEL_MISSING.search(message):
        return Answer(Verdict.REFUSED, status, message=message, fault=EndpointFault.REFUSED)
    if status in (408, 409, 425) or status >= 500:
        return Answer(
            Verdict.RETRY,
            status,
            message=message,
            retry_after_s=retry_after(headers),
            fault=EndpointFault.SERVER_ERROR,
        )
    if _CONTEXT_WORDS.search(message):
        return Answer(
            Verdict.ITEM_DEAD, status, message=message, error_class=ErrorClass.PROMPT_TOO_LONG
        )
    return Answer(
        Verdict.ITEM_DEAD, status, message=message, error_class=ErrorClass.INVALID_REQUEST
    )


def transport_fault(exc: BaseException, *, timeout_s: float) -> tuple[EndpointFault, str]:
    """What a request that got no HTTP answer ran into, in words a user acts on."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        where = f"{exc.host}:{exc.port}"
        cause = exc.os_error
        if isinstance(exc, aiohttp.ClientConnectorDNSError) or isinstance(cause, socket.gaierror):
            return EndpointFault.UNREACHABLE, f"host not found: {exc.host} ({cause.strerror})"
        if isinstance(cause, ConnectionRefusedError):
            return EndpointFault.UNREACHABLE, f"connection refused: nothing listens at {where}"
        if isinstance(exc, aiohttp.ClientConnectorCertificateError | aiohttp.ClientSSLError) or (
            isinstance(cause, ssl.SSLError)
        ):
            return EndpointFault.UNREACHABLE, f"TLS failed with {where}: {cause}"
        return EndpointFault.UNREACHABLE, f"cannot connect to {where}: {cause.strerror or cause}"
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return EndpointFault.TIMEOUT, f"no answer within {timeout_s:g} s (the endpoint's timeout)"
    return EndpointFault.CONNECTION_DROPPED, f"connection dropped: {type(exc).__name__}: {exc}"


def _error_message(raw: bytes) -> str:
    try:
        body = _decode(raw)
    except msgspec.DecodeError:
        return raw[:MESSAGE_CHARS].decode(errors="replace")
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            return str(error.get("message") or error)
        if isinstance(body.get("message"), str):
            return str(body["message"])
        return str(error)
    return str(body)


def retry_after(headers: Mapping[str, str]) -> float | None:
    """How long the endpoint asks us to wait: ``Retry-After`` (seconds or an HTTP
    date), ``retry-after-ms``, or an exhausted ``x-ratelimit-*`` window's reset."""
    if (ms := headers.get("retry-after-ms")) is not None:
        try:
            return max(float(ms) / 1000.0, 0.0)
        except ValueError:
            pass
    if (value := headers.get("Retry-After")) is not None:
        try:
            return max(float(value), 0.0)
        except ValueError:
            when = email.utils.parsedate_to_datetime(value) if value else None
            if when is not None:
                return max(when.timestamp() - time.time(), 0.0)
    waits = [
        _duration(headers.get(f"x-ratelimit-reset-{kind}"))
        for kind in ("requests", "tokens")
        if headers.get(f"x-ratelimit-remaining-{kind}") in ("0", "0.0")
    ]
    found = [w for w in waits if w is not None]
    return max(found) if found else None


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


def _duration(value: str | None) -> float | None:
    """OpenAI's reset durations: ``1s``, ``6m0s``, ``20ms``, ``1h2m3.5s``, or seconds."""
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = _DURATION.findall(value)
    return sum(float(n) * scale[u] for n, u in parts) if parts else None


def backoff_s(attempt: int, *, floor_s: float | None = None) -> float:
    """Full-jitter exponential backoff for the ``attempt``-th retry (0-based), never
    shorter than what the endpoint asked for."""
    jitter = random.uniform(0.0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * (2**attempt)))
    return max(jitter, floor_s or 0.0)
