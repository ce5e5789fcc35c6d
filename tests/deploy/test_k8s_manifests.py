"""The Kubernetes manifests under deploy/k8s, rendered and checked offline (`make k8s-check`).

- Built-in kinds against Kubernetes' own schemas (kubernetes-validate, strict: an
  unknown field is an error, as a typo would be).
- KEDA's kinds against the CRD schemas of the KEDA release shipped in
  deploy/k8s/schemas, and each trigger's metadata against KEDA's scaler metadata
  schema shipped beside it.
- What llm-batch computes: each ScaledObject's task queue is the one llm-batch names
  for its Deployment's model and task, its postgresql query is the ledger's, and the
  drain fits in the pod's grace period.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from llmbatch.config import Settings
from llmbatch.contract.spec import Task
from llmbatch.ledger.backlog import unfinished_items_query

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
SCHEMAS = ROOT / "schemas"
KUSTOMIZATIONS = [ROOT / "base", *sorted(p for p in (ROOT / "overlays").iterdir() if p.is_dir())]
# The oldest Kubernetes release the manifests are meant for.
KUBERNETES_VERSION = "1.30.0"
KEDA_KINDS = {
    "ScaledObject": "keda.sh_scaledobjects.yaml",
    "TriggerAuthentication": "keda.sh_triggerauthentications.yaml",
}


def render(kustomization: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize`` (or ``kustomize build``) of one folder, offline."""
    if shutil.which("kubectl"):
        command = ["kubectl", "kustomize", str(kustomization)]
    elif shutil.which("kustomize"):
        command = ["kustomize", "build", str(kustomization)]
    else:
        pytest.fail("neither kubectl nor kustomize is installed (apt-get install kubectl)")
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=KUSTOMIZATIONS, ids=lambda p: p.name)
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


def _crd_schema(kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((SCHEMAS / KEDA_KINDS[kind]).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
    return dict(version["schema"]["openAPIV3Schema"])


def _unknown_fields(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the schema does not declare (Kubernetes would silently drop them)."""
    found: list[str] = []
    if isinstance(value, dict) and "properties" in schema:
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return found
        for key, item in value.items():
            if key not in schema["properties"]:
                found.append(f"{path}.{key}")
            else:
                found += _unknown_fields(item, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for n, item in enumerate(value):
            found += _unknown_fields(item, schema["items"], f"{path}[{n}]")
    return found


def _scaler_parameters() -> dict[str, dict[str, dict[str, Any]]]:
    schema = json.loads((SCHEMAS / "keda-scalers-schema.json").read_text())
    return {s["type"]: {p["name"]: p for p in s["parameters"]} for s in schema["scalers"]}


def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in _by_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


def _option(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_built_in_kinds_are_valid_kubernetes(rendered: list[dict[str, Any]]) -> None:
    built_in = [d for d in rendered if d["kind"] not in KEDA_KINDS]
    assert {d["kind"] for d in built_in} >= {"Deployment", "ConfigMap", "Service", "Job"}
    for doc in built_in:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_keda_kinds_match_the_shipped_crds(rendered: list[dict[str, Any]]) -> None:
    for kind in KEDA_KINDS:
        schema = _crd_schema(kind)
        docs = _by_kind(rendered, kind)
        assert docs, f"no {kind}"
        for doc in docs:
            jsonschema.validate(doc, schema)
            assert _unknown_fields(doc, schema) == [], doc["metadata"]["name"]


def test_trigger_metadata_matches_kedas_scaler_schema(rendered: list[dict[str, Any]]) -> None:
    scalers = _scaler_parameters()
    for scaled in _by_kind(rendered, "ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            parameters = scalers[trigger["type"]]
            metadata = trigger["metadata"]
            for key, value in metadata.items():
                assert key in parameters, f"{trigger['type']} has no parameter {key}"
                assert parameters[key].get("metadataVariableReadable"), key
                assert isinstance(value, str), f"{key}: metadata values are strings"
            authenticated = "authenticationRef" in trigger
            for name, parameter in parameters.items():
                required = not parameter.get("optional") and "default" not in parameter
                given = name in metadata or (
                    authenticated and parameter.get("triggerAuthenticationVariableReadable")
                )
                assert given or not required, f"{trigger['type']} needs {name}"


def test_each_engine_queue_is_scaled_on_the_queue_llm_batch_computes(
    rendered: list[dict[str, Any]],
) -> None:
    config = _named(rendered, "ConfigMap", "llm-batch-config")["data"]
    settings = Settings(gpu_task_queue_prefix=config["LLMBATCH_GPU_TASK_QUEUE_PREFIX"])
    scaled_objects = _by_kind(rendered, "ScaledObject")
    gpu = [
        d
        for d in _by_kind(rendered, "Deployment")
        if "gpu" in d["spec"]["template"]["spec"]["containers"][0]["command"][:3]
    ]
    assert gpu and {s["spec"]["scaleTargetRef"]["name"] for s in scaled_objects} == {
        d["metadata"]["name"] for d in gpu
    }, "every GPU worker Deployment has a ScaledObject, and only they"
    for scaled in scaled_objects:
        target = _named(rendered, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
        command = target["spec"]["template"]["spec"]["containers"][0]["command"]
        model = _option(command, "--model")
        assert model is not None
        task = Task(_option(command, "--task") or Task.GENERATE)
        triggers = {t["type"]: t["metadata"] for t in scaled["spec"]["triggers"]}
        assert set(triggers) == {"temporal", "postgresql"}
        temporal = triggers["temporal"]
        assert temporal["taskQueue"] == settings.gpu_task_queue(model, task)
        assert temporal["namespace"] == config["LLMBATCH_TEMPORAL_NAMESPACE"]
        assert temporal["queueTypes"] == "activity"
        assert temporal["activationTargetQueueSize"] == "0"
        assert int(temporal["targetQueueSize"]) >= 1
        assert triggers["postgresql"]["query"] == unfinished_items_query(model, task)
        assert triggers["postgresql"]["activationTargetQueryValue"] == "0"
        assert scaled["spec"]["minReplicaCount"] == 0
        # At least one engine cold start (minutes for a real model).
        assert scaled["spec"]["cooldownPeriod"] >= 300


def test_gpu_workers_drain_within_their_grace_period(rendered: list[dict[str, Any]]) -> None:
    for scaled in _by_kind(rendered, "ScaledObject"):
        target = _named(rendered, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
        pod = target["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        drain = float(
            _option(container["command"], "--drain-timeout")
            or env.get("LLMBATCH_DRAIN_TIMEOUT")
            or Settings.model_fields["drain_timeout"].default.total_seconds()
        )
        # The engine's own exit takes a few seconds after the drain.
        assert pod["terminationGracePeriodSeconds"] >= drain + 3, target["metadata"]["name"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["readinessProbe"]["exec"]["command"][-1] == env["LLMBATCH_READY_FILE"]
        assert "replicas" not in target["spec"], "KEDA owns the replica count"
