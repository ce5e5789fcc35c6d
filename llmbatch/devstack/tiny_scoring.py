"""Tiny models for vLLM's score and classify tasks: a cross-encoder (reranker) and a
sequence classifier, with random weights, built once per recipe hash
(:mod:`~llmbatch.devstack.model_cache`).

Their scores and labels are random but deterministic: enough to check that a score or
classify request reaches the model and comes back as vLLM's own ``LLM.score`` and
``LLM.classify`` give it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmbatch.devstack import tiny_model
from llmbatch.devstack.model_cache import build_once

# Bump when the code below changes what is written for the same recipe.
VERSION = 1

# The classifier's classes, in the order of its logits.
CLASSIFIER_LABELS = ("negative", "neutral", "positive")

BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
BERT_VOCAB_SIZE = 2048
BERT_HIDDEN_SIZE = 128
BERT_HEADS = 2
BERT_LAYERS = 2
BERT_INTERMEDIATE_SIZE = 256
# A query and a document together: the cross-encoder's longest input.
BERT_MAX_TOKENS = 512


@dataclass(frozen=True, kw_only=True)
class TinyCrossEncoder:
    """The recipe of the tiny cross-encoder."""

    seed: int = 0

    def recipe(self) -> dict[str, Any]:
        return {
            "kind": "tiny-bert-cross-encoder",
            "version": VERSION,
            **dataclasses.asdict(self),
            "special_tokens": list(BERT_SPECIAL_TOKENS),
            "vocab_size": BERT_VOCAB_SIZE,
            "hidden_size": BERT_HIDDEN_SIZE,
            "heads": BERT_HEADS,
            "layers": BERT_LAYERS,
            "intermediate_size": BERT_INTERMEDIATE_SIZE,
            "max_tokens": BERT_MAX_TOKENS,
            "corpus": tiny_model.TinyLlama().recipe()["corpus_sha256"],
        }


def classifier_recipe(*, seed: int = 0) -> tiny_model.TinyLlama:
    """The tiny classifier's recipe: the tiny Llama with a classification head."""
    return tiny_model.TinyLlama(
        seed=seed, head="LlamaForSequenceClassification", labels=CLASSIFIER_LABELS
    )


def build_tiny_cross_encoder(path: Path, *, seed: int = 0) -> Path:
    """Build the tiny cross-encoder into ``path`` once; return ``path``.

    Architecture ``BertForSequenceClassification`` with one label, what the common
    rerankers of the sentence-transformers kind (MS MARCO MiniLM cross-encoders) ship
    as: vLLM 0.32 runs it natively on its pooling runner for ``LLM.score`` and
    ``/score``, ``/rerank``, scoring a (query, document) pair as one input with token
    types, the score being the sigmoid of its logit. Its tokenizer is a WordPiece one
    trained on the tiny Llama's corpus.
    """
    spec = TinyCrossEncoder(seed=seed)
    return build_once(path, spec.recipe(), lambda folder: _write_cross_encoder(folder, spec))


def build_tiny_classifier(path: Path, *, seed: int = 0) -> Path:
    """Build the tiny sequence classifier into ``path`` once; return ``path``.

    Architecture ``LlamaForSequenceClassification`` (the tiny Llama with a linear
    ``score`` head over its last token, labels :data:`CLASSIFIER_LABELS`), the shape
    of the decoder-based classifiers people fine-tune today; vLLM 0.32 turns the
    ``ForSequenceClassification`` name into its classify runner over its own Llama,
    so ``LLM.classify`` works with no ``--convert`` option, and the tokenizer is the
    tiny Llama's.
    """
    return tiny_model.build_llama(path, classifier_recipe(seed=seed))


def _write_cross_encoder(folder: Path, spec: TinyCrossEncoder) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = _train_wordpiece()
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=BERT_HIDDEN_SIZE,
        num_hidden_layers=BERT_LAYERS,
        num_attention_heads=BERT_HEADS,
        intermediate_size=BERT_INTERMEDIATE_SIZE,
        max_position_embeddings=BERT_MAX_TOKENS,
        type_vocab_size=2,
        pad_token_id=tokenizer.pad_token_id,
        # One label (num_labels follows id2label): a relevance logit.
        id2label={0: "LABEL_0"},
        label2id={"LABEL_0": 0},
        dtype="float32",
    )
    with tiny_model.seeded(spec.seed):
        model: Any = BertForSequenceClassification(config)
    model.eval()
    tiny_model.save_model(model, folder)
    tokenizer.save_pretrained(folder)


def _train_wordpiece() -> Any:
    """A lower-casing WordPiece tokenizer as BERT's, trained on the built-in corpus:
    ``[CLS] query [SEP] document [SEP]``, the document's token type 1."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    pad, unk, cls, sep, mask = BERT_SPECIAL_TOKENS
    tokenizer = Tokenizer(models.WordPiece(unk_token=unk))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=BERT_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(BERT_SPECIAL_TOKENS),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tiny_model.corpus_lines(), trainer)
    cls_id, sep_id = tokenizer.token_to_id(cls), tokenizer.token_to_id(sep)
    tokenizer.post_processor = TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, cls_id), (sep, sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=pad,
        unk_token=unk,
        cls_token=cls,
        sep_token=sep,
        mask_token=mask,
        model_max_length=BERT_MAX_TOKENS,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
