"""Records staged between a shard's steps, and the rows of the output files.

Staged objects are JSONL, one record a line, so a step streams them with bounded
memory; their keys are fixed by (job, shard), so a retried step overwrites its own.

They are written by these structs and read back by the next step of the same job, so
they are msgspec structs, encoded and decoded in C with no per-field validation:
pydantic validates at the boundaries (input rows, the job spec), not on every row of
every step. Profiled on the cached path, staging rows and requests as pydantic models
(``model_dump_json`` and ``model_construct``) cost the CPU and GPU workers about
30 µs an item; as structs it is a few.

The nested options (:class:`SamplingSpec`, :class:`EmbedSpec`) stay pydantic models:
they are validated once per distinct value of a staged object, and the rows that
carry equal options share one object.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel

from llmbatch.contract.spec import EmbedSpec, JobSpec, SamplingSpec
from llmbatch.contract.states import ErrorClass

# Options validated once per distinct value: what :func:`load_jsonl` reads as a model.
_OPTIONS: tuple[type[BaseModel], ...] = (SamplingSpec, EmbedSpec)

_encode_key = msgspec.json.encode


class _Staged(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A staged record; fields left at their defaults are not written."""


class StagedRow(_Staged):
    """One input row as read by ``prepare_shard``; ``fields`` is None when it was unreadable."""

    item_id: str
    ordinal: int
    source: str
    fields: dict[str, Any] | None = None
    error_class: ErrorClass | None = None
    error: str | None = None


class StagedRequest(_Staged):
    """One request as rendered by ``prepare_shard``: chat ``messages`` or a raw
    ``prompt`` (an OpenAI /v1/completions request) to generate from, or (embed jobs)
    the ``texts`` to embed, one vector each."""

    item_id: str
    source: str
    # Chat messages as given (a content may be a list of parts, not only text).
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    # A /v1/completions prompt given as the model's token ids (instead of ``prompt``).
    prompt_token_ids: list[int] | None = None
    sampling: SamplingSpec | None = None  # None: the job's sampling
    texts: list[str] | None = None
    # A /v1/embeddings input given as token ids: one vector per list (instead of texts).
    token_ids: list[list[int]] | None = None
    embedding: EmbedSpec | None = None  # None: the job's embed options
    # The request key (llmbatch.dedup.keys.request_key) as render worked it out for
    # the ledger's prompt_hash, so generate does not hash every request again. None in
    # objects staged before it was kept: then generate works it out.
    key: str | None = None

    def effective_sampling(self, spec: JobSpec) -> SamplingSpec:
        """The sampling this item runs with: its own (an OpenAI batch line's, or a
        re-drive's overrides) or else its job's. The one place this is worked out: the
        request key, the engine request and dedup must agree on it."""
        return self.sampling or spec.sampling


M = TypeVar("M", bound=_Staged)


def dump_jsonl(records: Iterable[_Staged]) -> bytes:
    """Staged records as JSONL, one a line. JSON escapes every line break inside a
    value, so a record never spans lines."""
    # Rows that share an options object share its dump, worked out once.
    dumped: dict[int, tuple[BaseModel, dict[str, Any]]] = {}

    def options(value: Any) -> Any:
        if not isinstance(value, _OPTIONS):
            raise TypeError(f"cannot stage a {type(value).__name__}")
        hit = dumped.get(id(value))
        if hit is None or hit[0] is not value:
            # Fields left at their defaults are not written: the job's options and a
            # line's few own ones are most of a staged request's bytes otherwise.
            hit = dumped[id(value)] = (value, value.model_dump(mode="json", exclude_defaults=True))
        return hit[1]

    encoder = msgspec.json.Encoder(enc_hook=options)
    buffer = bytearray()
    for record in records:
        encoder.encode_into(record, buffer, -1)
        buffer += b"\n"
    return bytes(buffer)


def load_jsonl(data: bytes, model: type[M]) -> Iterator[M]:
    """The records of :func:`dump_jsonl`'s output as ``model`` (blank lines skipped).

    Equal nested options are validated once and read as one object: the engine
    worker finds its prepared sampling by the object, not by serializing the options
    again for every request."""
    known: dict[bytes, Any] = {}

    def options(kind: type, raw: Any) -> Any:
        if kind not in _OPTIONS:
            # msgspec's dec_hook protocol for a type the hook does not decode (not a stub).
            raise NotImplementedError(kind)
        key = kind.__name__.encode() + _encode_key(raw)
        value = known.get(key)
        if value is None:
            value = known[key] = kind.model_validate(raw)  # type: ignore[attr-defined]
        return value

    yield from msgspec.json.Decoder(model, dec_hook=options).decode_lines(data)
