"""The tiny cross-encoder and classifier: their tokenizers and configs, and that vLLM's
``LLM.score`` and ``LLM.classify`` give what transformers gives on the same inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from llmbatch.devstack.tiny_scoring import CLASSIFIER_LABELS
from tests.fixtures.offline_llm import run_llm

QUERY = "Which industry is a law firm in?"
DOCUMENTS = [
    "A law firm gives legal advice on contracts, disputes and tax law.",
    "The quick brown fox jumps over the lazy dog.",
    "Banks, insurance and payments are finance.",
]
TEXTS = ["Thank you for your message.", "It is sunny and warm today.", "Refund my order!"]


def test_cross_encoder_encodes_a_pair_with_token_types(tiny_cross_encoder_path: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((tiny_cross_encoder_path / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert len(config["id2label"]) == 1  # one logit: a relevance score
    tokenizer: Any = AutoTokenizer.from_pretrained(tiny_cross_encoder_path)
    pair = tokenizer(QUERY, DOCUMENTS[0])
    tokens = tokenizer.convert_ids_to_tokens(pair.input_ids)
    assert tokens[0] == "[CLS]" and tokens.count("[SEP]") == 2 and tokens[-1] == "[SEP]"
    first_sep = tokens.index("[SEP]")
    assert set(pair.token_type_ids[: first_sep + 1]) == {0}
    assert set(pair.token_type_ids[first_sep + 1 :]) == {1}


def test_classifier_is_the_tiny_llama_with_labels(tiny_classifier_path: Path) -> None:
    config = json.loads((tiny_classifier_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert [config["id2label"][str(i)] for i in range(3)] == list(CLASSIFIER_LABELS)
    assert config["pad_token_id"] is not None  # transformers finds the last token by it


@pytest.mark.slow
def test_cross_encoder_scores_in_vllm(tiny_cross_encoder_path: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    script = """
model, query, documents = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = load(model, runner="pooling")
scores = llm.score(query, documents, use_tqdm=False)
done(scores=[o.outputs.score for o in scores])
"""
    result = run_llm(
        script,
        str(tiny_cross_encoder_path),
        QUERY,
        json.dumps(DOCUMENTS),
        log=tmp_path / "tiny-cross-encoder.log",
    )
    tokenizer: Any = AutoTokenizer.from_pretrained(tiny_cross_encoder_path)
    model: Any = AutoModelForSequenceClassification.from_pretrained(tiny_cross_encoder_path)
    with torch.no_grad():
        batch = tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS, return_tensors="pt", padding=True)
        expected = torch.sigmoid(model.eval()(**batch).logits[:, 0]).tolist()
    assert len(result["scores"]) == len(DOCUMENTS)
    for want, got in zip(expected, result["scores"], strict=True):
        assert math.isclose(want, got, abs_tol=1e-4)
    assert len(set(result["scores"])) == len(DOCUMENTS)  # the document matters


@pytest.mark.slow
def test_classifier_classifies_in_vllm(tiny_classifier_path: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    script = """
model, texts = sys.argv[1], json.loads(sys.argv[2])
llm = load(model, runner="pooling")
outputs = llm.classify(texts, use_tqdm=False)
done(probs=[o.outputs.probs for o in outputs])
"""
    result = run_llm(
        script, str(tiny_classifier_path), json.dumps(TEXTS), log=tmp_path / "tiny-classifier.log"
    )
    tokenizer: Any = AutoTokenizer.from_pretrained(tiny_classifier_path)
    model: Any = AutoModelForSequenceClassification.from_pretrained(tiny_classifier_path)
    for text, probs in zip(TEXTS, result["probs"], strict=True):
        assert len(probs) == len(CLASSIFIER_LABELS)
        assert math.isclose(sum(probs), 1.0, abs_tol=1e-5)
        with torch.no_grad():
            logits = model.eval()(**tokenizer(text, return_tensors="pt")).logits[0]
        for want, got in zip(torch.softmax(logits, -1).tolist(), probs, strict=True):
            assert math.isclose(want, got, abs_tol=1e-4)
