"""A tiny Llama-architecture model built on this machine, for tests and the demo.

Model weights cannot be downloaded here, so llm-batch builds one: random weights
(seeded), a small byte-level BPE tokenizer trained on a built-in corpus, and a chat
template, saved as a Hugging Face folder of about 2 MB that vLLM loads like any
other. Head size is 64, which vLLM's CPU attention supports. Its answers are random.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

MARKER = "llm-batch-tiny-model.json"
VERSION = 1

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = """
Batch inference runs a model over many rows: classify support tickets, extract fields
from contracts, summarise reports and label data. Every row comes back exactly once.
Companies: Law Firm, Healthcare, Technology, Retail, Consulting, Manufacturing, Finance,
Real Estate, Other. Legal services, medical centers, software labs, outfitters, markets,
advisors, industries, capital, bank, realty, properties, holdings and sons.
North Blue Summit Cedar Harbor Pioneer Atlas Bright Iron Vista group partners center.
The quick brown fox jumps over the lazy dog. A dog, the sea, tax law, a bicycle, rain,
a city, music and bread. Say hello. Write about the weather. Which industry is it in?
You are brief. You sort companies into industries. Answer with the industry only.
Company, City, Country, Website, Phone, Email, Subscription Date, Customer Id, Index.
{"label": "a", "answer": "b", "name": "value", "items": [1, 2, 3], "ok": true}
0 1 2 3 4 5 6 7 8 9 10 100 1000 yes no true false null
"""


def build_tiny_model(path: Path, *, seed: int = 0) -> Path:
    """Build the tiny model into ``path`` (idempotent) and return ``path``."""
    path = Path(path)
    marker = path / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == {"version": VERSION, "seed": seed}:
        return path
    # Heavy imports only when a model is really built.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.strip().splitlines() * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
    )

    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.eval()

    # Build beside the target and swap in, so a crash never leaves half a model.
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        fast.save_pretrained(staging)
        (staging / MARKER).write_text(json.dumps({"version": VERSION, "seed": seed}))
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path
