"""How many tokens a request's prompt holds, before it is sent: the one estimate the
rate budget (TPM) and ``submit --estimate`` both use.

With the model's tokenizer where it is at hand (``tokenizer.json`` in a local model
folder or the local Hugging Face cache; nothing is downloaded), read with the
``tokenizers`` library alone, so a remote worker loads neither transformers nor torch;
else characters / 4 (English text in BPE vocabularies averages ~4 characters a
token). A chat's template is not rendered: each message adds
:data:`TOKENS_PER_MESSAGE` for its role and markers. The endpoint's reported usage
corrects the budget after each answer.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from llmbatch.engine.requests import GenerationRequest

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4.0
TOKENS_PER_MESSAGE = 4


class PromptTokens:
    """Counts prompt tokens for one model."""

    def __init__(self, tokenizer: Any = None) -> None:
        # A ``tokenizers.Tokenizer`` (or anything with ``encode(text).ids``), or None.
        self._tokenizer = tokenizer

    @classmethod
    def for_model(cls, model: str) -> PromptTokens:
        return cls(_load_tokenizer(model))

    @property
    def exact(self) -> bool:
        """Whether texts are counted by the model's tokenizer (else estimated)."""
        return self._tokenizer is not None

    def text(self, text: str) -> int:
        if self._tokenizer is not None:
            with contextlib.suppress(Exception):
                return len(self._tokenizer.encode(text, add_special_tokens=False).ids)
        return int(len(text) / CHARS_PER_TOKEN) + 1

    def request(self, request: GenerationRequest) -> int:
        """A generation request's prompt: its messages' contents, or the raw prompt (as
        text or as token ids)."""
        if request.prompt_token_ids is not None:
            return len(request.prompt_token_ids)
        if request.messages is not None:
            return sum(
                self.text(str(m.get("content") or "")) + TOKENS_PER_MESSAGE
                for m in request.messages
            )
        return self.text(request.prompt or "")

    def texts(self, texts: list[str]) -> int:
        """An embedding request's inputs."""
        return sum(self.text(t) for t in texts)


def _load_tokenizer(model: str) -> Any:
    """The model's fast tokenizer when its ``tokenizer.json`` is on this machine."""
    try:
        from tokenizers import Tokenizer

        local = Path(model) / "tokenizer.json"
        if local.is_file():
            return Tokenizer.from_file(str(local))
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "tokenizer.json")
        if isinstance(cached, str):
            return Tokenizer.from_file(cached)
        log.info("no tokenizer.json for %s: prompt tokens estimated as chars/4", model)
    except Exception as exc:  # any failure means: estimate
        log.info("no tokenizer for %s (%s): prompt tokens estimated as chars/4", model, exc)
    return None
