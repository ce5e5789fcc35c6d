"""``llm-batch codec-server`` and ``llm-batch codec-key rotate``: payload encryption.

Neither prints a key: only key ids. See :mod:`llmbatch.security.codec`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmbatch.cli._support.common import emit_json, fail

app = typer.Typer()
keys_app = typer.Typer(no_args_is_help=True)
app.add_typer(keys_app, name="codec-key", help="Payload encryption keys: rotate them.")


@app.command("codec-server")
def codec_server(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int | None, typer.Option(help="Port (default: LLMBATCH_CODEC_SERVER_PORT).")
    ] = None,
    ui_origin: Annotated[
        list[str] | None,
        typer.Option(
            help="A Web UI origin allowed to call it from a browser (CORS); repeatable. "
            "Default: the embedded stack's Web UI."
        ),
    ] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option(help="A file holding the API key (default: LLMBATCH_CODEC_SERVER_API_KEY)."),
    ] = None,
) -> None:
    """Serve Temporal's remote codec protocol (/encode, /decode) with the configured
    keyring, for the Web UI (--ui-codec-endpoint) and `temporal workflow show
    --codec-endpoint URL --codec-auth "Bearer KEY"`."""
    import uvicorn

    from llmbatch.config import Settings
    from llmbatch.security.codec import KeyringError, load_keyring, state_keyring_path
    from llmbatch.security.codec_server import codec_app

    settings = Settings()
    try:
        keyring = load_keyring(settings)
    except KeyringError as exc:
        raise fail(str(exc)) from None
    if keyring is None:
        raise fail(
            "no codec keyring: set LLMBATCH_CODEC_KEYS or LLMBATCH_CODEC_KEYS_FILE, "
            "or run `llm-batch dev up --encrypt`"
        )
    if api_key_file is not None:
        try:
            api_key = api_key_file.read_text().strip()
        except OSError as exc:
            raise fail(f"cannot read the API key file {api_key_file}: {exc.strerror}") from None
    elif settings.codec_server_api_key is not None:
        api_key = settings.codec_server_api_key.get_secret_value()
    else:
        api_key = ""
    if not api_key:
        raise fail(
            "the codec server needs an API key: LLMBATCH_CODEC_SERVER_API_KEY or --api-key-file"
        )
    # A keyring read from a file follows it (`codec-key rotate` writes there).
    keyring_file = None
    if settings.codec_keys is None:
        keyring_file = settings.codec_keys_file or state_keyring_path(settings)
    server = codec_app(
        keyring=keyring,
        api_key=api_key,
        ui_origins=ui_origin or [settings.web_ui_url],
        keyring_file=keyring_file,
    )
    # Access logs would print the Web UI's endpoint path, which may hold the key.
    uvicorn.run(
        server,
        host=host,
        port=port or settings.codec_server_port,
        access_log=False,
        log_level="warning",
    )


@keys_app.command("rotate")
def rotate(
    file: Annotated[
        Path | None,
        typer.Option(
            help="The keyring file (default: LLMBATCH_CODEC_KEYS_FILE, else the state "
            "folder's codec-keys.json). Made if missing."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the key ids as JSON.")] = False,
) -> None:
    """Add a new random key and make it current: new payloads use it, older ones still
    decrypt with the keys kept. Workers read the keyring when they start (restart
    them); a running codec server reading this file follows it at once."""
    from llmbatch.config import Settings
    from llmbatch.security.codec import (
        KeyringError,
        new_keyring,
        read_keyring_file,
        state_keyring_path,
        write_keyring,
    )

    settings = Settings()
    path = file or settings.codec_keys_file or state_keyring_path(settings)
    try:
        keyring = read_keyring_file(path).rotated() if path.exists() else new_keyring()
    except KeyringError as exc:
        raise fail(str(exc)) from None
    write_keyring(path, keyring)
    if as_json:
        emit_json({"file": str(path), "current": keyring.current, "keys": sorted(keyring.keys)})
        return
    typer.echo(f"{path}: current key {keyring.current} ({len(keyring.keys)} keys)")
