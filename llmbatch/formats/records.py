"""Records staged between a shard's steps, and the rows of the output files.

Staged objects are JSONL, one record a line, so a step streams them with bounded
memory; their keys are fixed by (job, shard), so a retried step overwrites its own.

They are written by these models and read back by the next step of the same job, so
they are decoded with msgspec and built without validating every field again
(:meth:`_Staged.from_staged`): pydantic validates at the boundaries (input rows, the
job spec), not on every row of every step. Profiled on the cached path, validating
staged rows was a tenth of the CPU worker's time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Self, TypeVar

import msgspec
from pydantic import BaseModel

from llmbatch.contract.spec import EmbedSpec, JobSpec, SamplingSpec
from llmbatch.contract.states import ErrorClass

M = TypeVar("M", bound="_Staged")

_decode_lines = msgspec.json.Decoder().decode_lines
_encode = msgspec.json.encode

N = TypeVar("N", bound=BaseModel)


class _Staged(BaseModel):
    @classmethod
    def from_staged(cls, record: dict[str, Any], known: dict[bytes, Any]) -> Self:
        """A record as :func:`dump_jsonl` wrote it, without validating it again.
        ``known``: nested options already validated while reading the same object."""
        return cls.model_construct(**record)


def _validated_once(raw: Any, model: type[N], known: dict[bytes, Any]) -> N:
    """``raw`` validated as ``model``, once per distinct value of a staged object: the
    rows of an OpenAI batch file mostly carry equal options, and the one object they
    then share is what the engine worker finds its prepared sampling by (by identity,
    not by serializing the options again for every request)."""
    key = model.__name__.encode() + _encode(raw)
    value = known.get(key)
    if value is None:
        value = known[key] = model.model_validate(raw)
    return value  # type: ignore[no-any-return]


class StagedRow(_Staged):
    """One input row as read by ``fetch_shard``; ``fields`` is None when it was unreadable."""

    item_id: str
    ordinal: int
    source: str
    fields: dict[str, Any] | None = None
    error_class: ErrorClass | None = None
    error: str | None = None

    @classmethod
    def from_staged(cls, record: dict[str, Any], known: dict[bytes, Any]) -> Self:
        error_class = record.get("error_class")
        if error_class is not None:
            record["error_class"] = ErrorClass(error_class)
        return cls.model_construct(**record)


class StagedRequest(_Staged):
    """One request as rendered by ``render_prompts``: chat ``messages`` or a raw
    ``prompt`` (an OpenAI /v1/completions request) to generate from, or (embed jobs)
    the ``texts`` to embed, one vector each."""

    item_id: str
    source: str
    messages: list[dict[str, str]] | None = None
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

    @classmethod
    def from_staged(cls, record: dict[str, Any], known: dict[bytes, Any]) -> Self:
        # Nested options (an OpenAI line's own, a re-drive's) are validated.
        if record.get("sampling") is not None:
            record["sampling"] = _validated_once(record["sampling"], SamplingSpec, known)
        if record.get("embedding") is not None:
            record["embedding"] = _validated_once(record["embedding"], EmbedSpec, known)
        return cls.model_construct(**record)

    def effective_sampling(self, spec: JobSpec) -> SamplingSpec:
        """The sampling this item runs with: its own (an OpenAI batch line's, or a
        re-drive's overrides) or else its job's. The one place this is worked out: the
        request key, the engine request and dedup must agree on it."""
        return self.sampling or spec.sampling


def dump_jsonl(records: Iterable[BaseModel]) -> bytes:
    """Staged records as JSONL, one a line. JSON escapes every line break inside a
    value, so a record never spans lines."""
    return b"".join(r.model_dump_json().encode() + b"\n" for r in records)


def load_jsonl(data: bytes, model: type[M]) -> Iterator[M]:
    """The records of :func:`dump_jsonl`'s output as ``model`` (blank lines skipped)."""
    known: dict[bytes, Any] = {}
    for record in _decode_lines(data):
        yield model.from_staged(record, known)
