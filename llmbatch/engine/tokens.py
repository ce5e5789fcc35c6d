"""Text to token ids for the engine's prompts, at the cost of the tokenizer itself.

transformers' ``encode`` wraps the Rust tokenizer of a fast (``tokenizers``) backend
in ~20 µs of Python per call, as much as the encoding itself on a short prompt, and
vLLM's thread-safe wrapper adds to it. The engine tokenizes every prompt it runs,
on the process that also feeds the engine, so it calls the Rust tokenizer directly
where that gives the same ids: a fast backend with no truncation or padding set.
Any other tokenizer is called as transformers has it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer

# encode(text, add_special_tokens) -> token ids
Encode = Callable[[str, bool], list[int]]


def encoder(tokenizer: Any) -> Encode:
    """How to encode text with ``tokenizer`` (a transformers or vLLM tokenizer)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        isinstance(backend, Tokenizer)
        and backend.truncation is None
        and backend.padding is None
        and not getattr(tokenizer, "split_special_tokens", False)
    ):

        def fast(text: str, add_special_tokens: bool) -> list[int]:
            # Read-only on the Rust side (no truncation or padding to set), so sharing
            # it with vLLM's detokenizer on the same event loop is safe.
            return backend.encode(text, add_special_tokens=add_special_tokens).ids

        return fast

    def general(text: str, add_special_tokens: bool) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    return general
