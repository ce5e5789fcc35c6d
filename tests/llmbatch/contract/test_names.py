"""How models are named where jobs, workers and the OpenAI API meet."""

from __future__ import annotations

import pytest

from llmbatch.contract.names import model_identity


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B-Instruct", "org/m", "tiny", "tiny-58f42be7"])
def test_a_model_id_is_itself(model: str) -> None:
    assert model_identity(model) == model
    assert model_identity(model + "/") == model


def test_a_local_path_is_named_by_its_folder_and_a_hash_of_the_path() -> None:
    name = model_identity("/models/tiny")
    assert name.startswith("tiny-") and "/" not in name
    # One model however it ends, and the name is a name of the same model.
    assert model_identity("/models/tiny/") == name == model_identity(name)
    # Folders of one name in two places may hold other weights: two names.
    assert model_identity("/other/tiny") != name
    for relative in ("./tiny", "../models/tiny", "~/models/tiny"):
        assert model_identity(relative).startswith("tiny-")
