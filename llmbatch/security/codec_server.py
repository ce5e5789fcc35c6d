"""Temporal's remote codec protocol over HTTP, for operators who hold a key.

``POST /decode`` and ``POST /encode`` take and return ``{"payloads": [...]}``
(Temporal's ``Payloads`` message as protobuf JSON: ``metadata`` values and ``data``
in base64), as the Web UI (``--ui-codec-endpoint``) and ``temporal workflow show
--codec-endpoint URL --codec-auth "Bearer KEY"`` call them.

Every call needs the server's API key: ``Authorization: Bearer KEY``; or, for the
Web UI, which sends no credentials of its own unless it has a login, the key as the
endpoint's first path segment (``http://host:port/KEY``, so ``/KEY/decode``).
CORS lets the Web UI's origin (and only the origins given) call it from a browser.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from llmbatch.security.codec import (
    DecryptError,
    EncryptionCodec,
    Keyring,
    KeyringError,
    read_keyring_file,
)

log = logging.getLogger(__name__)

BEARER = "Bearer "


class _Codecs:
    """The codec of the keyring, read again from ``keyring_file`` whenever that file
    changes: ``llm-batch codec-key rotate`` writes a new current key there, and the
    server must decode what workers now encrypt with it, without a restart."""

    def __init__(self, keyring: Keyring, keyring_file: Path | None) -> None:
        self._file = keyring_file
        self._stamp = self._stat()
        self._codec = EncryptionCodec(keyring)

    def _stat(self) -> tuple[int, int] | None:
        if self._file is None:
            return None
        try:
            found = self._file.stat()
        except OSError:
            return None
        return found.st_mtime_ns, found.st_size

    def current(self) -> EncryptionCodec:
        stamp = self._stat()
        if stamp is not None and stamp != self._stamp and self._file is not None:
            try:
                self._codec = EncryptionCodec(read_keyring_file(self._file))
            except KeyringError as exc:  # half-written or broken: keep the keys we have
                log.warning("codec keyring %s not reloaded: %s", self._file, exc)
            else:
                self._stamp = stamp
                log.warning("codec keyring reloaded from %s", self._file)
        return self._codec


def codec_app(
    *,
    keyring: Keyring,
    api_key: str,
    ui_origins: Sequence[str],
    keyring_file: Path | None = None,
) -> FastAPI:
    """The codec server's app: ``/encode`` and ``/decode`` behind ``api_key``; with
    ``keyring_file`` (where ``keyring`` was read from), its keys follow that file."""
    if not api_key:
        raise ValueError("the codec server needs an API key")
    codecs = _Codecs(keyring, keyring_file)
    app = FastAPI(title="llm-batch codec server", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(ui_origins),
        allow_methods=["POST", "OPTIONS"],
        allow_headers=["Content-Type", "X-Namespace", "Authorization"],
        allow_credentials=True,
    )

    def authorize(request: Request, path_key: str | None) -> None:
        header = request.headers.get("authorization", "")
        given = path_key if path_key is not None else header.removeprefix(BEARER)
        if path_key is None and not header.startswith(BEARER):
            given = ""
        # Constant time: the comparison says nothing of how much of a guess was right.
        if not given or not secrets.compare_digest(given.encode(), api_key.encode()):
            raise HTTPException(status_code=401, detail="a valid API key is required")

    async def payloads_of(request: Request) -> Payloads:
        try:
            body = await request.body()
            return json_format.Parse(body, Payloads(), ignore_unknown_fields=True)
        except (json_format.ParseError, UnicodeDecodeError):
            raise HTTPException(status_code=400, detail="the body is not a Payloads JSON") from None

    def answer(payloads: Sequence[Any]) -> JSONResponse:
        message = Payloads(payloads=list(payloads))
        return JSONResponse(json_format.MessageToDict(message))

    async def decode(request: Request, path_key: str | None = None) -> JSONResponse:
        authorize(request, path_key)
        try:
            return answer(await codecs.current().decode((await payloads_of(request)).payloads))
        except DecryptError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None

    async def encode(request: Request, path_key: str | None = None) -> JSONResponse:
        authorize(request, path_key)
        return answer(await codecs.current().encode((await payloads_of(request)).payloads))

    app.add_api_route("/decode", decode, methods=["POST"])
    app.add_api_route("/encode", encode, methods=["POST"])
    app.add_api_route("/{path_key}/decode", decode, methods=["POST"])
    app.add_api_route("/{path_key}/encode", encode, methods=["POST"])
    return app
