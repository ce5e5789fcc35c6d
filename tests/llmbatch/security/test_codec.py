"""The AES-256-GCM payload codec and its keyring (no server needed)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from pydantic import SecretStr
from temporalio.api.common.v1 import Payload

from llmbatch.client.temporal import data_converter
from llmbatch.config import Settings
from llmbatch.contract.spec import ChatMessage, JobSpec
from llmbatch.security.codec import (
    ENCODING,
    META_KEY_ID,
    DecryptError,
    EncryptionCodec,
    KeyringError,
    load_keyring,
    new_keyring,
    parse_keyring,
    state_keyring_path,
    write_keyring,
)

SECRET_TEXT = "canary-4f1e row text"


def spec() -> JobSpec:
    return JobSpec(
        job_id="codec-1",
        inputs=["s3://b/in.jsonl"],
        messages=[ChatMessage(role="user", content=f"{SECRET_TEXT} {{{{ name }}}}")],
        model="m",
        output_uri="s3://b/out",
    )


async def test_payloads_are_sealed_under_the_current_key_and_open_again() -> None:
    keyring = new_keyring()
    converter = data_converter(keyring)
    (sealed,) = await converter.encode([spec()])

    assert sealed.metadata["encoding"] == ENCODING
    assert sealed.metadata[META_KEY_ID] == keyring.current.encode()
    assert SECRET_TEXT.encode() not in sealed.SerializeToString()
    (opened,) = await converter.decode([sealed], [JobSpec])
    assert opened == spec()
    # A fresh nonce each time: equal payloads do not look equal.
    (again,) = await converter.encode([spec()])
    assert again.data != sealed.data


async def test_after_rotation_new_payloads_use_the_new_key_and_old_ones_still_open() -> None:
    old = new_keyring()
    rotated = old.rotated()
    (before,) = await data_converter(old).encode([spec()])
    (after,) = await data_converter(rotated).encode([spec()])

    assert rotated.current != old.current and set(old.keys) < set(rotated.keys)
    assert after.metadata[META_KEY_ID] == rotated.current.encode()
    for sealed in (before, after):
        (opened,) = await data_converter(rotated).decode([sealed], [JobSpec])
        assert opened == spec()
    # The old keyring cannot open what the new key sealed, and says which key it lacks.
    with pytest.raises(DecryptError, match=rotated.current):
        await EncryptionCodec(old).decode([after])


async def test_an_altered_payload_is_refused_and_plain_ones_pass() -> None:
    codec = EncryptionCodec(new_keyring())
    (sealed,) = await codec.encode([Payload(metadata={"encoding": b"json/plain"}, data=b"{}")])
    tampered = Payload()
    tampered.CopyFrom(sealed)
    tampered.data = sealed.data[:-1] + bytes([sealed.data[-1] ^ 1])
    with pytest.raises(DecryptError, match="does not decrypt"):
        await codec.decode([tampered])
    # Histories from before encryption was turned on stay readable.
    plain = Payload(metadata={"encoding": b"json/plain"}, data=b'"x"')
    assert await codec.decode([plain]) == [plain]


def test_keyring_errors_and_printing_never_show_a_key(tmp_path: Path) -> None:
    keyring = new_keyring()
    raw = base64.b64encode(keyring.keys[keyring.current]).decode()
    assert raw not in repr(keyring) and raw not in str(keyring)

    short = json.dumps({"current": "a", "keys": {"a": base64.b64encode(b"x" * 16).decode()}})
    with pytest.raises(KeyringError, match="16 bytes, not 32") as bad:
        parse_keyring(short, source="LLMBATCH_CODEC_KEYS")
    assert base64.b64encode(b"x" * 16).decode() not in str(bad.value)
    missing = json.dumps({"current": "b", "keys": {"a": raw}})
    with pytest.raises(KeyringError, match="'b' is not among the keys") as bad:
        parse_keyring(missing, source="f")
    assert raw not in str(bad.value)


def test_the_keyring_comes_from_the_environment_a_file_or_the_state_folder(
    tmp_path: Path,
) -> None:
    settings = Settings(state_dir=tmp_path / "state")
    assert load_keyring(settings) is None  # nothing configured: no encryption

    in_state = new_keyring()
    write_keyring(state_keyring_path(settings), in_state)
    assert state_keyring_path(settings).stat().st_mode & 0o777 == 0o600
    assert load_keyring(settings) == in_state

    in_file = new_keyring()
    write_keyring(tmp_path / "keys.json", in_file)
    assert (
        load_keyring(settings.model_copy(update={"codec_keys_file": tmp_path / "keys.json"}))
        == in_file
    )

    inline = new_keyring()
    both = settings.model_copy(
        update={
            "codec_keys": SecretStr(inline.to_json()),
            "codec_keys_file": tmp_path / "keys.json",
        }
    )
    assert load_keyring(both) == inline

    gone = settings.model_copy(update={"codec_keys_file": tmp_path / "missing.json"})
    with pytest.raises(KeyringError, match=r"missing\.json"):
        load_keyring(gone)
