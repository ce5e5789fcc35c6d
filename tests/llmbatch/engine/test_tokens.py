"""llmbatch.engine.tokens: the Rust tokenizer's ids are transformers' ids."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from llmbatch.engine.tokens import encoder

TEXTS = [
    "Write about the sea (17).",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew lines\r\n",
    "naïve café — 東京 🙂",
    "<s> a BOS in the text </s> and an EOS",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    # As the engine gets it (vLLM's cached, thread-safe wrapper of the fast tokenizer).
    from vllm.tokenizers import get_tokenizer
    from vllm.tokenizers.hf import maybe_make_thread_pool

    return maybe_make_thread_pool(get_tokenizer(str(tiny_model_path)))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_the_same_ids_as_transformers(tokenizer: Any, add_special_tokens: bool) -> None:
    encode = encoder(tokenizer)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False
    )
    for text in [*TEXTS, chat]:
        expected = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        assert encode(text, add_special_tokens) == expected, text


def test_the_rust_tokenizer_is_called_directly(tokenizer: Any) -> None:
    wrapped = copy.deepcopy(tokenizer)

    def refuse(*args: Any, **kwargs: Any) -> list[int]:
        raise AssertionError("transformers' encode was called")

    wrapped.encode = refuse
    assert encoder(wrapped)("Hello there", True) == list(tokenizer.encode("Hello there"))


def test_truncation_left_set_on_the_rust_tokenizer_is_not_applied(tokenizer: Any) -> None:
    # transformers truncates only when asked; the Rust tokenizer would apply whatever
    # was left set on it, so then the encoder calls transformers.
    truncating = copy.deepcopy(tokenizer)
    truncating._tokenizer.enable_truncation(max_length=3)
    text = "one two three four five six"
    assert len(truncating._tokenizer.encode(text, add_special_tokens=False).ids) == 3
    assert encoder(truncating)(text, False) == list(
        tokenizer.encode(text, add_special_tokens=False)
    )
