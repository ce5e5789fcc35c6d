"""A tiny Llama-architecture model built on this machine, for tests and the demo, and
the parts the other tiny models share with it.

Model weights cannot be downloaded here, so llm-batch builds one: random weights
(seeded), a small byte-level BPE tokenizer trained on a built-in corpus, and a chat
template, saved as a Hugging Face folder of about 2 MB that vLLM loads like any
other. Head size is 64, which vLLM's CPU attention supports. Its answers are random.

:class:`TinyLlama` is the recipe: the seed, tokens beyond the chat markers, the chat
template and the head (``LlamaForCausalLM``, or ``LlamaForSequenceClassification``
with labels). :func:`build_llama` builds any of them once, cached by the recipe's
hash (:mod:`~llmbatch.devstack.model_cache`); :func:`build_tiny_model` is the plain
chat model. The other tiny models (:mod:`~llmbatch.devstack.tiny_vision`,
:mod:`~llmbatch.devstack.tiny_scoring`, :mod:`~llmbatch.devstack.tiny_lora`) take
their tokenizer, text config and seeding from here.

Nothing is downloaded: the config, the tokenizer and the weights are all made here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmbatch.devstack.model_cache import MARKER, build_once

__all__ = [
    "BOS",
    "CHAT_TEMPLATE",
    "EOS",
    "MARKER",
    "PAD",
    "SPECIAL_TOKENS",
    "TinyLlama",
    "build_llama",
    "build_tiny_model",
]

# Bump when the code below changes what is written for the same recipe, so old
# folders are rebuilt (what the recipe holds changes the hash by itself).
VERSION = 3

VOCAB_SIZE = 2048
HIDDEN_SIZE = 128
NUM_HEADS = 2  # head size 64
NUM_LAYERS = 2
INTERMEDIATE_SIZE = 256
MAX_POSITION_EMBEDDINGS = 2048

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

Head = Literal["LlamaForCausalLM", "LlamaForSequenceClassification"]


@dataclass(frozen=True, kw_only=True)
class TinyLlama:
    """The recipe of a tiny Llama: what its folder is built from.

    ``extra_special_tokens`` join the chat markers as single special tokens (a vision
    model's ``<image>``); ``added_tokens`` are single tokens that decoding keeps (a
    tool model's ``<tool_call>``, which a tool parser must see); ``labels`` name a classifier's
    classes, in order, and are required with the classification head only.
    """

    seed: int = 0
    extra_special_tokens: tuple[str, ...] = ()
    added_tokens: tuple[str, ...] = ()
    chat_template: str = CHAT_TEMPLATE
    head: Head = "LlamaForCausalLM"
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.head == "LlamaForSequenceClassification") != bool(self.labels):
            raise ValueError("labels go with the classification head, and it needs them")

    @property
    def special_tokens(self) -> list[str]:
        return [*SPECIAL_TOKENS, *self.extra_special_tokens]

    def recipe(self) -> dict[str, Any]:
        """All that decides the folder's bytes, for its cache hash."""
        return {
            "kind": "tiny-llama",
            "version": VERSION,
            **dataclasses.asdict(self),
            **text_sizes(),
            "corpus_sha256": hashlib.sha256(_CORPUS.encode()).hexdigest(),
        }


def build_tiny_model(path: Path, *, seed: int = 0) -> Path:
    """Build the tiny chat model into ``path`` unless it is already there; return ``path``.

    The same ``seed`` gives byte-identical files (config, tokenizer and weights).
    A folder from an older version or another seed is replaced. The folder appears
    complete or not at all: it is built beside ``path`` and renamed into place.
    """
    return build_llama(path, TinyLlama(seed=seed))


def build_llama(path: Path, spec: TinyLlama) -> Path:
    """Build the tiny Llama of ``spec`` into ``path`` once (see :func:`build_tiny_model`)."""
    return build_once(path, spec.recipe(), lambda folder: _write_llama(folder, spec))


def text_sizes() -> dict[str, int]:
    """The tiny Llama's sizes, as the recipes record them."""
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "num_heads": NUM_HEADS,
        "num_layers": NUM_LAYERS,
        "intermediate_size": INTERMEDIATE_SIZE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
    }


def corpus_lines() -> list[str]:
    """The built-in corpus the tokenizers are trained on, one text a line."""
    return [line for line in _CORPUS.strip().splitlines() if line.strip()]


_CORPUS = """
Batch inference runs a model over many rows at once: classify support tickets, extract
fields from contracts, summarise reports, translate product descriptions and label data
for training. Every row comes back exactly once, even when a machine fails halfway.
A job reads its input from storage, splits it into shards, renders a prompt for each row,
generates an answer on the graphics processors and writes the results next to the input.

The quick brown fox jumps over the lazy dog. A dog sleeps by the fire while rain falls on
the roof. The sea was calm this morning, and the fishermen went out before sunrise. In the
city the streets were busy with bicycles, buses, taxis and people walking to work.
Write about the weather. It is sunny and warm today, with a light wind from the west;
tomorrow brings clouds, thunder and heavy showers in the afternoon, then a cold night.

She baked fresh bread with flour, water, salt and yeast, and served it with butter, cheese,
tomatoes and olive oil. The kitchen smelled of coffee, garlic, onions and lemons. For
dinner they cooked rice, chicken, beans and vegetables, and shared an apple pie for dessert.

The museum opened a new exhibition about music, painting and history. Children played in
the garden, read books in the library and learned about planets, stars, rivers, mountains,
forests and animals: horses, birds, cats, lions, whales, bees and butterflies.

The train to the coast leaves every hour from the central station. Travellers carry
maps, cameras, umbrellas and sandwiches; some sleep, some talk, some watch the fields,
villages, bridges and lighthouses go by. At the hotel a friendly receptionist explains
where to find breakfast, the swimming pool, the beach and the old harbour.

Good software is tested, reviewed and documented. Engineers write functions, classes and
modules, fix bugs, measure latency and throughput, and deploy new versions carefully.
A database stores tables of records; a queue delivers messages; a worker processes tasks
and reports progress; a scheduler retries failures with exponential backoff.

Dear customer, thank you for your message. We received your order and will ship it within
three business days. If you have questions about your invoice, your account, a refund or
a delivery, please reply to this email or call our support team. Kind regards, the team.

You are a helpful assistant. You are brief. You sort companies into industries. Answer
with the industry only. Which industry is this company in? Classify the following text.
Summarise the document in one sentence. Extract the name, the date and the amount.
Answer yes or no. Return a JSON object with the fields label, answer, score and reason.

Industries: Law Firm, Healthcare, Technology, Retail, Consulting, Manufacturing, Finance,
Real Estate, Other. A law firm gives legal advice on contracts, disputes, tax law and
intellectual property. Healthcare covers hospitals, clinics, doctors, nurses, pharmacies
and medical devices. Technology means software, hardware, cloud services, networks, data
and security. Retail sells clothing, groceries, electronics and furniture in stores and
online. Consulting firms advise on strategy, operations, people and change. Manufacturing
makes steel, chemicals, machines, cars, textiles and food products in factories. Finance
includes banks, insurance, investment funds, payments, lending and accounting. Real estate
buys, sells, leases and manages homes, offices, warehouses and land.

Acme Holdings, North Star Partners, Blue Summit Capital, Cedar Harbor Realty, Pioneer
Manufacturing Group, Atlas Legal Associates, Bright Path Healthcare, Iron Valley Steel,
Vista Retail Outlet, Evergreen Consulting, Silver Lake Bank, Golden Gate Insurance,
Riverside Medical Center, Quantum Software Labs, Redwood Data Systems, Harbor Point
Properties, Summit Advisory, Maple Leaf Foods, Oak and Sons Furniture, Crescent Pharmacy,
Global Logistics Solutions, United Textile Mills, First National Trust, Clearwater
Dental Clinic, Apex Engineering Works, Sterling and Hart LLP, Nova Cloud Inc, Prime
Market Ltd, Orion Networks Corp, Willow Creek Homes, Falcon Security Services.

Company, Name, City, Country, Website, Phone, Email, Address, Subscription Date, Customer
Id, Index, Industry, Description, Employees, Revenue, Founded, Street, State, Zip, Region.
London, Paris, Berlin, Madrid, Rome, Tokyo, Sydney, Toronto, Chicago, Boston, Seattle,
Dallas, Denver, Miami, Dublin, Oslo, Vienna, Zurich, Lisbon, Prague, Warsaw, Mumbai.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May
June July August September October November December spring summer autumn winter.
{"label": "a", "answer": "b", "name": "value", "score": 0.5, "items": [1, 2, 3], "ok": true}
{"industry": "Retail", "reason": "sells goods", "confidence": "high", "valid": false}
0 1 2 3 4 5 6 7 8 9 10 11 12 20 25 50 75 100 250 500 1000 2024 2025 yes no true false null
one two three four five six seven eight nine ten first second third last next previous
"""


def _write_llama(folder: Path, spec: TinyLlama) -> None:
    # Heavy imports only when a model is really built.
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = train_tokenizer(
        special_tokens=spec.special_tokens,
        added_tokens=spec.added_tokens,
        chat_template=spec.chat_template,
    )
    config = llama_text_config(tokenizer)
    config.architectures = [spec.head]
    if spec.labels:
        config.num_labels = len(spec.labels)
        config.id2label = dict(enumerate(spec.labels))
        config.label2id = {label: i for i, label in enumerate(spec.labels)}
    with seeded(spec.seed):
        if spec.head == "LlamaForSequenceClassification":
            model: Any = LlamaForSequenceClassification(config)
        else:
            model = LlamaForCausalLM(config)
    model.eval()
    zero_special_embeddings(model, tokenizer, [*spec.special_tokens, *spec.added_tokens])
    model.generation_config = generation_config(tokenizer)
    save_model(model, folder)
    tokenizer.save_pretrained(folder)


def llama_text_config(tokenizer: Any) -> Any:
    """The tiny Llama's config for ``tokenizer`` (a ``LlamaConfig``)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        head_dim=HIDDEN_SIZE // NUM_HEADS,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def generation_config(tokenizer: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch inside the block only: a private generator state, so building a
    model never disturbs the caller's RNG."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def zero_special_embeddings(model: Any, tokenizer: Any, tokens: Sequence[str]) -> None:
    """Zero the input embeddings of ``tokens``.

    With tied weights their logits are then 0 while the best ordinary token's is above
    0, so greedy decoding writes visible text (random words) instead of stray chat
    markers, and runs to max_tokens.
    """
    import torch

    with torch.no_grad():
        model.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids(list(tokens))] = 0.0


def save_model(model: Any, folder: Path) -> None:
    """``save_pretrained`` as safetensors, without the progress bar."""
    with quiet_progress_bars():
        model.save_pretrained(folder, safe_serialization=True)


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """No transformers progress bars inside the block: a "Writing model shards" bar
    for a 2 MB file is noise in the demo's output."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def train_tokenizer(
    *,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    added_tokens: Sequence[str] = (),
    chat_template: str | None = CHAT_TEMPLATE,
    specials_last: bool = False,
) -> Any:
    """A byte-level BPE tokenizer trained on the built-in corpus (a
    ``PreTrainedTokenizerFast``): ``special_tokens`` are single tokens, the first three
    being pad, bos and eos; their ids are 0..n-1 in order, or come after the vocabulary
    with ``specials_last`` (CLIP's processing takes id 0 for an ordinary token).
    ``added_tokens`` come after the vocabulary as single tokens that are not special
    (decoding with ``skip_special_tokens`` keeps them)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[] if specials_last else list(special_tokens),
        # Every byte is a token, so any text (any language, any emoji) can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer)
    if specials_last:
        tokenizer.add_special_tokens(list(special_tokens))
    tokenizer.add_tokens([AddedToken(token, special=False) for token in added_tokens])
    pad, bos, eos = special_tokens[:3]
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        chat_template=chat_template,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
