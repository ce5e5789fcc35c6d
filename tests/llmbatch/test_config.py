"""Settings precedence: keyword > LLMBATCH_* environment > TOML file > defaults."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from llmbatch.config import Settings, redact
from llmbatch.contract.names import model_identity, model_slug


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    import os

    for name in list(os.environ):
        if name.startswith("LLMBATCH_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no stray ./llm-batch.toml
    return monkeypatch


def test_defaults_point_at_the_embedded_stack(clean_env: pytest.MonkeyPatch) -> None:
    s = Settings()
    assert s.temporal_address == "127.0.0.1:7233"
    assert s.postgres_dsn.get_secret_value().startswith("postgresql://")
    assert s.s3_endpoint_url == "http://127.0.0.1:8333"
    assert s.web_ui_url == "http://127.0.0.1:8233"
    assert s.migrations_dir is None  # the migrations shipped with llm-batch


def test_file_then_env_then_keywords(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "conf.toml"
    config.write_text(
        'temporal_namespace = "from-file"\ns3_bucket = "file-bucket"\ncpu_task_queue = "file-q"\n'
    )
    clean_env.setenv("LLMBATCH_CONFIG", str(config))
    clean_env.setenv("LLMBATCH_S3_BUCKET", "env-bucket")
    clean_env.setenv("LLMBATCH_CPU_TASK_QUEUE", "env-q")

    s = Settings(cpu_task_queue="kw-q")

    assert s.temporal_namespace == "from-file"
    assert s.s3_bucket == "env-bucket"
    assert s.cpu_task_queue == "kw-q"


def test_local_toml_file_is_read(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "llm-batch.toml").write_text('s3_bucket = "local-file"\n')
    assert Settings().s3_bucket == "local-file"


def test_missing_config_file_is_an_error(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("LLMBATCH_CONFIG", str(tmp_path / "absent.toml"))
    with pytest.raises(FileNotFoundError, match=r"absent\.toml"):
        Settings()


def test_secrets_do_not_show_in_repr(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LLMBATCH_S3_SECRET_ACCESS_KEY", "hunter2")
    s = Settings()
    assert "hunter2" not in repr(s)
    assert s.s3_secret_access_key.get_secret_value() == "hunter2"


@pytest.mark.parametrize(
    ("model", "readable"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", "llm-batch-gpu-generate-qwen-qwen2.5-0.5b-instruct-"),
        # A local path by its folder's name and the path's hash (no server path shown).
        ("/tmp/models/tiny-llama/", "llm-batch-gpu-generate-tiny-llama-"),
    ],
)
def test_gpu_queue_is_named_for_the_task_and_the_whole_model(
    clean_env: pytest.MonkeyPatch, model: str, readable: str
) -> None:
    queue = Settings().gpu_task_queue(model)
    assert queue.startswith(readable) and model_slug(model) in queue
    assert queue == Settings().gpu_task_queue(model.rstrip("/") + "/")
    # A job naming the model as GET /v1/models lists it reaches the same workers.
    assert queue == Settings().gpu_task_queue(model_identity(model))


def test_models_that_share_a_last_segment_or_a_slug_get_their_own_queues(
    clean_env: pytest.MonkeyPatch,
) -> None:
    # Named from the last segment, '/other/place/Model' took work meant for '/tmp/x/model'.
    models = ["/tmp/x/model", "/other/place/Model", "/other/place/model", "org/m", "org-m"]
    queues = {Settings().gpu_task_queue(m) for m in models}
    assert len(queues) == len(models)
    long = Settings().gpu_task_queue("/data/" + "m" * 900)
    assert len(long) < 200 and re.fullmatch(r"[a-z0-9._-]+", long)


def test_local_roots_are_a_path_list_defaulting_to_the_working_directory(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert Settings().local_roots == [tmp_path]  # clean_env works in tmp_path
    clean_env.setenv("LLMBATCH_LOCAL_ROOTS", f"/data{os.pathsep}rel{os.pathsep}")
    # Relative roots are fixed against the working directory when read.
    assert Settings().local_roots == [Path("/data"), tmp_path / "rel"]
    clean_env.setenv("LLMBATCH_LOCAL_ROOTS", "/")
    assert Settings().local_roots == [Path("/")]
    clean_env.setenv("LLMBATCH_LOCAL_ROOTS", os.pathsep)
    with pytest.raises(ValueError, match="at least one folder"):
        Settings()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://postgres:s3cr%40t@db.internal:5432/llm", "postgresql://postgres:***@db.internal:5432/llm"),
        ("postgresql://u:pw@h/db?sslmode=require&password=pw", "postgresql://u:***@h/db?sslmode=require&password=***"),
        ("postgresql://postgres@127.0.0.1:55432/llmbatch", "postgresql://postgres@127.0.0.1:55432/llmbatch"),
        ("http://127.0.0.1:8333", "http://127.0.0.1:8333"),
        ("postgresql://u:pw@[::1", "***"),  # unparseable: nothing of it is shown
    ],
)  # fmt: skip
def test_redact_hides_every_password_and_keeps_where(url: str, shown: str) -> None:
    assert redact(url) == shown
