"""What makes two requests the same, and what identifies a model's weights.

:func:`request_key` is the ledger's ``prompt_hash`` and the key of in-job
deduplication; :func:`cache_key` adds the weights for the result cache across jobs,
so a model whose weights changed under the same name never answers from old results.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import msgspec

from llmbatch.contract.names import model_identity
from llmbatch.contract.spec import EmbedSpec, SamplingSpec

log = logging.getLogger(__name__)

# Files of a local model folder that decide its answers: weights, configs, tokenizer
# and chat template. Other files (README, images) may change without a new fingerprint.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".jinja")
# Read in blocks: a 15 GB checkpoint must not be held in memory to be hashed.
_BLOCK = 8 << 20


def request_key(
    *,
    model: str,
    messages: Any,
    sampling: SamplingSpec,
    prompt: str | None = None,
    prompt_token_ids: list[int] | None = None,
    texts: list[str] | None = None,
    token_ids: list[list[int]] | None = None,
    embedding: EmbedSpec | None = None,
) -> str:
    """sha256 of everything that decides a request's result: the model as named, the
    rendered chat messages or the raw prompt (a completions request, as text or token
    ids), every sampling parameter (``params`` too: n, logprobs, penalties, ...) and
    the structured-output constraint (part of the sampling); for an embed request, the
    texts (or token ids) and the embed options."""
    what: list[Any] = [messages]
    if prompt is not None:
        what = ["prompt", prompt]
    elif prompt_token_ids is not None:
        what = ["prompt_token_ids", prompt_token_ids]
    if texts is not None or token_ids is not None:
        options = embedding.model_dump(mode="json") if embedding else None
        what = ["embed", texts, options] if token_ids is None else ["embed_ids", token_ids, options]
    # The JSON of [model, *what, sampling] with the sampling's part spliced in (the
    # same text as dumping the whole list): most requests of a job share one sampling
    # object, so its dump is worked out once, not once per request.
    head = (
        _encode_sorted([model_identity(model), messages]).decode()
        if what[0] is messages and _text_messages(messages)
        else _dumps([model_identity(model), *what])
    )
    body = f"{head[:-1]},{_sampling_json(sampling)}]"
    return hashlib.sha256(body.encode()).hexdigest()


def _dumps(value: Any) -> str:
    """``value`` as compact JSON with sorted keys and raw non-ASCII text: the text every
    key so far was hashed from. msgspec writes the same text ten times faster, except
    for floats (``1e+16`` is ``1e16`` there): a value holding one goes through json."""
    if _floatless(value):
        return _encode_sorted(value).decode()
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _text_messages(messages: Any) -> bool:
    """Whether ``messages`` are what parsing and rendering make of chat messages: dicts
    of text to text. The common request's check, a fifth of :func:`_floatless`'s time
    (which walks any JSON value), with the same answer for such messages."""
    return type(messages) is list and all(
        type(m) is dict and all(type(k) is str and type(v) is str for k, v in m.items())
        for m in messages
    )


def _encode_sorted(value: Any) -> bytes:
    return msgspec.json.encode(value, order="sorted")


def _floatless(value: Any) -> bool:
    """Whether ``value`` (JSON data) holds no float: chat messages, prompts, token ids."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is list or kind is tuple:
        return all(_floatless(v) for v in value)
    if kind is dict:
        return all(type(k) is str and _floatless(v) for k, v in value.items())
    return False


# id -> (the sampling object, its JSON). The object is held, so its id is not reused
# while the entry lives; sampling objects are never changed once made (with_overrides
# makes a new one). Cleared when full: a job has a handful, an OpenAI file maybe more.
_SAMPLING_JSON: dict[int, tuple[SamplingSpec, str]] = {}
_SAMPLING_JSON_ENTRIES = 1024


def _sampling_json(sampling: SamplingSpec) -> str:
    hit = _SAMPLING_JSON.get(id(sampling))
    if hit is not None and hit[0] is sampling:
        return hit[1]
    # Without params, the sampling dumps as it did before there were any: keys (and
    # the result cache) stay valid across the upgrade.
    text = _dumps(sampling.model_dump(mode="json", exclude=None if sampling.params else {"params"}))
    if len(_SAMPLING_JSON) >= _SAMPLING_JSON_ENTRIES:
        _SAMPLING_JSON.clear()
    _SAMPLING_JSON[id(sampling)] = (sampling, text)
    return text


def cache_key(request: str, weights: str, *, scope: str | None = None) -> str:
    """The result cache's key: a request key, the weights that answer it, and the
    tenant whose results it may answer from (:func:`cache_scope`; None: every job's)."""
    what = f"{request}\n{weights}" if scope is None else f"{request}\n{weights}\n{scope}"
    return hashlib.sha256(what.encode()).hexdigest()


def cache_scope(tenant: str | None, *, shared: bool) -> str | None:
    """Whose cached results a job of ``tenant`` may be answered from: its tenant's
    only, so one tenant never gets (nor, by timing, learns of) another's results,
    unless the operator shares the cache across tenants on purpose
    (``LLMBATCH_CACHE_SHARED_ACROSS_TENANTS``). Jobs without a tenant share one scope."""
    return None if shared or tenant is None else f"tenant:{tenant}"


def cache_anonymous(tenant: str | None, scope: str | None) -> bool:
    """Whether a cache hit for a job of ``tenant`` in ``scope`` must not name the job
    it came from: in a cache shared across tenants it may be another tenant's."""
    return scope is None and tenant is not None


def weights_fingerprint(model: str, *, revision: str | None = None) -> str | None:
    """What identifies the weights a worker loaded for ``model``, or None when nothing
    does (then nothing is cached: an unknown model must never answer from the cache).

    A local folder: sha256 over the names, sizes and contents of its weight, config and
    tokenizer files (read once per worker, at engine load, while the engine reads them
    too). A Hugging Face id: the revision given, else the commit of the snapshot in the
    local Hugging Face cache (its folder name), which a new upload changes.
    """
    path = Path(model)
    if path.is_dir():
        return "sha256:" + _folder_digest(path)
    if revision and len(revision) == 40:  # a commit hash pins the weights
        return f"hf:{model}@{revision}"
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception as exc:  # no hub library, or a malformed id
        log.info("no weights fingerprint for %s: %s", model, exc)
        return None
    if isinstance(found, str):
        return f"hf:{model}@{Path(found).parent.name}"
    return None


def _folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    for file in files:
        relative = file.relative_to(folder).as_posix()
        digest.update(f"{relative}\0{os.path.getsize(file)}\0".encode())
        with file.open("rb") as f:
            while block := f.read(_BLOCK):
                digest.update(block)
    return digest.hexdigest()
