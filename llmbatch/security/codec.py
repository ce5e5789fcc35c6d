"""Encrypted payloads: an AES-256-GCM Temporal payload codec with a keyring.

Every payload llm-batch puts in Temporal (workflow and activity inputs and results,
memos, summaries, queries, heartbeat details, and failure messages, which the data
converter moves into an encoded attribute) is encrypted with the keyring's current
key; the key's id travels in the payload's metadata, so a payload made under an
older key still decrypts while that key stays in the keyring. Rotating is adding a
new key and making it current.

The format is the one of Temporal's encryption samples in every SDK, so a service in
another language joins with the same keys:

- metadata ``encoding`` = ``binary/encrypted``, ``encryption-cipher`` = ``AES256-GCM``,
  ``encryption-key-id`` = the key's id;
- data = a 12-byte random nonce, then AES-256-GCM of the original ``Payload`` message
  (protobuf-serialized) with no associated data.

The keyring is JSON, ``{"current": "<id>", "keys": {"<id>": "<base64 of 32 bytes>"}}``,
read from ``LLMBATCH_CODEC_KEYS`` (the JSON itself), ``LLMBATCH_CODEC_KEYS_FILE``, or
``codec-keys.json`` in the state folder (``llm-batch dev up --encrypt`` writes it).
Key material is never logged or put in an error message: errors name the source.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

from llmbatch.config import Settings
from llmbatch.errors import LlmBatchError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

ENCODING = b"binary/encrypted"
CIPHER = b"AES256-GCM"
META_ENCODING = "encoding"
META_CIPHER = "encryption-cipher"
META_KEY_ID = "encryption-key-id"
NONCE_BYTES = 12
KEY_BYTES = 32
# The file `llm-batch dev up --encrypt` writes in the state folder.
STATE_KEYRING_FILE = "codec-keys.json"


class KeyringError(LlmBatchError, ValueError):
    """The keyring cannot be used; the message names its source, never a key."""


# In DecryptError's message for a key the keyring lacks, and what to do about it.
DECRYPT_HINT_MARK = "which the keyring does not hold"
DECRYPT_HINT = (
    "give every worker a keyring that holds that key: `llm-batch codec-key rotate` keeps "
    "old keys, so copy its keyring to the workers and restart them"
)


class DecryptError(LlmBatchError, ValueError):
    """A payload cannot be decrypted (unknown key id, or tampered or wrong-key data)."""


class Keyring(BaseModel):
    """Named AES-256 keys; new payloads use ``current``, any key decrypts its own."""

    model_config = ConfigDict(frozen=True)

    current: str = Field(min_length=1, description="Id of the key new payloads use.")
    keys: dict[str, bytes] = Field(description="Key id -> 32 key bytes (base64 in JSON).")

    @field_validator("keys", mode="before")
    @classmethod
    def _decode_keys(cls, value: object) -> object:
        if not isinstance(value, Mapping):
            return value
        decoded: dict[str, bytes] = {}
        for key_id, raw in value.items():
            if isinstance(raw, bytes):
                decoded[str(key_id)] = raw
                continue
            try:
                decoded[str(key_id)] = base64.b64decode(str(raw), validate=True)
            except (binascii.Error, ValueError):
                # Not the value: it is the secret.
                raise ValueError(f"key {key_id!r} is not base64") from None
        return decoded

    @field_validator("keys")
    @classmethod
    def _key_sizes(cls, value: dict[str, bytes]) -> dict[str, bytes]:
        if not value:
            raise ValueError("no keys")
        for key_id, key in value.items():
            if len(key) != KEY_BYTES:
                raise ValueError(f"key {key_id!r} is {len(key)} bytes, not {KEY_BYTES}")
        return value

    def model_post_init(self, __context: object) -> None:
        if self.current not in self.keys:
            raise ValueError(f"the current key {self.current!r} is not among the keys")

    def __repr__(self) -> str:
        # Never the key bytes, wherever a keyring is printed.
        return f"Keyring(current={self.current!r}, key_ids={sorted(self.keys)!r})"

    __str__ = __repr__

    def to_json(self) -> str:
        """The keyring's JSON form (holds the keys: write it only to a private file)."""
        keys = {k: base64.b64encode(v).decode() for k, v in self.keys.items()}
        return json.dumps({"current": self.current, "keys": keys}, indent=2)

    def rotated(self, key_id: str | None = None) -> Keyring:
        """This keyring with a new random key that becomes current; old keys stay."""
        key_id = key_id or new_key_id()
        if key_id in self.keys:
            raise KeyringError(f"the keyring already has a key {key_id!r}")
        return Keyring(current=key_id, keys={**self.keys, key_id: _new_key()})


def new_key_id() -> str:
    """A key id that sorts by creation time and is unique: ``k<UTC time>-<random>``."""
    return f"k{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def new_keyring() -> Keyring:
    """A keyring holding one fresh random key."""
    key_id = new_key_id()
    return Keyring(current=key_id, keys={key_id: _new_key()})


def parse_keyring(text: str, *, source: str) -> Keyring:
    """Read a keyring's JSON; :class:`KeyringError` names ``source`` and what is wrong."""
    try:
        return Keyring.model_validate_json(text)
    except ValidationError as exc:
        # Pydantic's own message quotes the input (the keys): only locations and reasons.
        reasons = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'keyring'}: {err['msg']}"
            for err in exc.errors(include_input=False, include_url=False)
        )
        raise KeyringError(f"the codec keyring in {source} is not usable: {reasons}") from None


def write_keyring(path: Path, keyring: Keyring) -> None:
    """Write ``keyring`` to ``path``, readable by its owner only, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(keyring.to_json())
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def read_keyring_file(path: Path) -> Keyring:
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeyringError(f"cannot read the codec keyring {path}: {exc.strerror}") from None
    return parse_keyring(text, source=str(path))


def state_keyring_path(settings: Settings) -> Path:
    """Where ``llm-batch dev up --encrypt`` keeps the keyring of a state folder."""
    return settings.state_dir.resolve() / STATE_KEYRING_FILE


def load_keyring(settings: Settings) -> Keyring | None:
    """The configured keyring, or None when payloads are not encrypted.

    First found wins: ``LLMBATCH_CODEC_KEYS``, ``LLMBATCH_CODEC_KEYS_FILE`` (which must
    exist), the state folder's ``codec-keys.json``.
    """
    if settings.codec_keys is not None:
        return parse_keyring(settings.codec_keys.get_secret_value(), source="LLMBATCH_CODEC_KEYS")
    if settings.codec_keys_file is not None:
        return read_keyring_file(settings.codec_keys_file)
    path = state_keyring_path(settings)
    return read_keyring_file(path) if path.is_file() else None


def _new_key() -> bytes:
    # cryptography is imported where a key or cipher is made: a process without a
    # keyring (most CLI calls) never loads it.
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM.generate_key(256)


class EncryptionCodec(PayloadCodec):
    """AES-256-GCM payload codec over a :class:`Keyring` (see the module docstring)."""

    def __init__(self, keyring: Keyring) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._keyring = keyring
        self._ciphers: dict[str, AESGCM] = {
            key_id: AESGCM(key) for key_id, key in keyring.keys.items()
        }

    @property
    def key_id(self) -> str:
        return self._keyring.current

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encrypt(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decrypt(p) for p in payloads]

    def encrypt(self, payload: Payload) -> Payload:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._ciphers[self.key_id].encrypt(nonce, payload.SerializeToString(), None)
        return Payload(
            metadata={
                META_ENCODING: ENCODING,
                META_CIPHER: CIPHER,
                META_KEY_ID: self.key_id.encode(),
            },
            data=nonce + sealed,
        )

    def decrypt(self, payload: Payload) -> Payload:
        """The original payload; one that is not encrypted passes through as it is
        (histories from before encryption was turned on stay readable)."""
        if payload.metadata.get(META_ENCODING) != ENCODING:
            return payload
        key_id = payload.metadata.get(META_KEY_ID, b"").decode(errors="replace")
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise DecryptError(
                f"payload encrypted with key {key_id!r}, {DECRYPT_HINT_MARK} "
                f"(it holds {', '.join(sorted(self._ciphers))})"
            )
        from cryptography.exceptions import InvalidTag

        data = payload.data
        try:
            plain = cipher.decrypt(data[:NONCE_BYTES], data[NONCE_BYTES:], None)
        except InvalidTag:
            raise DecryptError(
                f"payload under key {key_id!r} does not decrypt: altered, or another key "
                "with the same id"
            ) from None
        original = Payload()
        original.ParseFromString(plain)
        return original
