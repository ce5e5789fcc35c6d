"""A tiny Llama-architecture model built on this machine, for tests and the demo.

Model weights cannot be downloaded here, so llm-batch builds one: random weights
(seeded), a small byte-level BPE tokenizer trained on a built-in corpus, and a chat
template, saved as a Hugging Face folder of about 2 MB that vLLM loads like any
other. Head size is 64, which vLLM's CPU attention supports. Its answers are random.

Nothing is downloaded: the config, the tokenizer and the weights are all made here.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MARKER = "llm-batch-tiny-model.json"
# Bump when anything below changes what is written, so old folders are rebuilt.
VERSION = 2

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


def build_tiny_model(path: Path, *, seed: int = 0) -> Path:
    """Build the tiny model into ``path`` unless it is already there; return ``path``.

    The same ``seed`` gives byte-identical files (config, tokenizer and weights).
    A folder from an older version or another seed is replaced. The folder appears
    complete or not at all: it is built beside ``path`` and renamed into place.
    """
    path = Path(path)
    if _is_built(path, seed):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a model folder is not a secret
    try:
        _write_model(staging, seed)
        # The marker goes last: a folder without it was never finished.
        (staging / MARKER).write_text(_marker(seed))
        if path.exists():
            shutil.rmtree(path)
        try:
            staging.rename(path)
        except OSError:
            # Another process built it at the same moment; theirs is as good as ours.
            if not _is_built(path, seed):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _marker(seed: int) -> str:
    return json.dumps({"version": VERSION, "seed": seed}, sort_keys=True)


def _is_built(path: Path, seed: int) -> bool:
    with contextlib.suppress(OSError):
        return (path / MARKER).read_text() == _marker(seed)
    return False


def _write_model(folder: Path, seed: int) -> None:
    # Heavy imports only when a model is really built.
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer()
    config = LlamaConfig(
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
    # Seed a private generator state so building never disturbs the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = LlamaForCausalLM(config)
    model.eval()
    # Zero embeddings for the special tokens: with tied weights their logits are then 0
    # while the best ordinary token's is above 0, so greedy decoding writes visible text
    # (random words) instead of stray chat markers, and runs to max_tokens.
    with torch.no_grad():
        special = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)
        model.get_input_embeddings().weight[special] = 0.0
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with _quiet_progress_bars():
        model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    # A "Writing model shards" bar for a 2 MB file is noise in the demo's output.
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        # Every byte is a token, so any text (any language, any emoji) can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.strip().splitlines() if line.strip()]
    tokenizer.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
