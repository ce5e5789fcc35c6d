"""Imports run one way. Workflow modules import only the contract: the sandbox
re-imports whatever they import on every run, and an I/O library imported there
(asyncpg, boto3, vLLM) has crashed a worker before. Checked in a fresh interpreter, so
the test sees exactly what importing the workflows pulls in, transitively. Below, each
package of llmbatch is held to the imports its docstring allows."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

WORKFLOW_MODULES = [
    "llmbatch.workflows.batch_job",
    "llmbatch.workflows.shard",
    "llmbatch.workflows.dead_letter",
    "llmbatch.workflows.provider_batch",
]
FORBIDDEN = ("asyncpg", "boto3", "botocore", "vllm", "torch", "jinja2", "pyarrow")


def test_workflows_import_only_the_contract_of_llmbatch() -> None:
    modules = _loaded(*WORKFLOW_MODULES)
    ours = [m for m in modules if m.startswith("llmbatch.") and m != "llmbatch.workflows"]
    ours = [m for m in ours if not m.startswith("llmbatch.workflows.")]
    assert ours, "the workflows import no contract at all?"
    # The contract's errors descend from llmbatch.errors, which imports nothing.
    assert [m for m in ours if not _within(m, {"llmbatch.contract", *EVERYWHERE})] == []
    assert [m for m in modules if m.split(".")[0] in FORBIDDEN] == []


# --- the packages of llmbatch: what each may import ------------------------------------
# Each package's docstring says what it owns and what it may import; these tables say
# the same, and the test below holds every module to them. A package may always import
# itself, and the standard library and third-party packages are not checked here.
# Every package may import the root of llm-batch's exceptions (it imports nothing).
EVERYWHERE = {"llmbatch.errors"}

ALLOWED: dict[str, set[str]] = {
    "llmbatch.contract": set(),
    "llmbatch.ledger": {"llmbatch.contract"},
    "llmbatch.storage": {"llmbatch.config", "llmbatch.contract"},
    "llmbatch.rendering": {"llmbatch.contract"},
    "llmbatch.security": {"llmbatch.config"},
    "llmbatch.engine": {"llmbatch.contract", "llmbatch.telemetry", "llmbatch.dedup.keys"},
    "llmbatch.dedup": {"llmbatch.contract", "llmbatch.ledger"},
    "llmbatch.formats": {
        "llmbatch.contract",
        "llmbatch.storage",
        "llmbatch.rendering",
    },
    "llmbatch.stages": {
        "llmbatch.config",
        "llmbatch.contract",
        "llmbatch.ledger",
        "llmbatch.dedup",
        "llmbatch.engine.base",
        "llmbatch.engine.errors",
        "llmbatch.engine.requests",
        "llmbatch.formats",
        "llmbatch.rendering",
        "llmbatch.storage",
        "llmbatch.tables",
        "llmbatch.telemetry",
        "llmbatch.remote.pause",
    },
    "llmbatch.tables": {
        "llmbatch.config",
        "llmbatch.contract",
        "llmbatch.formats",
        "llmbatch.rendering.limits",
    },
    "llmbatch.remote": {
        "llmbatch.contract",
        "llmbatch.engine",
        "llmbatch.ledger.db",
        "llmbatch.telemetry",
    },
    "llmbatch.provider": {
        "llmbatch.contract",
        "llmbatch.engine.requests",
        "llmbatch.formats.openai_output",
        "llmbatch.ledger.db",
        "llmbatch.remote",
    },
    "llmbatch.client": {
        "llmbatch.config",
        "llmbatch.contract",
        "llmbatch.security",
        "llmbatch.telemetry",
    },
}
# Imports made only for type checking (under ``if TYPE_CHECKING:``), never at run time.
TYPES_ONLY: dict[str, set[str]] = {
    "llmbatch.formats": {"llmbatch.ledger.items"},
}
OUR_TOPS = ("llmbatch",)
# Top-level folders of the repository that install as llmbatch.<name> (setup.py).
MAPPED = ("workflows", "activities", "workers", "migrations")
UPPER = {f"llmbatch.{m}" for m in MAPPED}
ROOT = Path(__file__).resolve().parents[3]


def _imports(path: Path) -> list[tuple[str, bool]]:
    """Every module ``path`` imports from this repository, and whether only for types."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from llmbatch.dedup import keys`` imports llmbatch.dedup.keys.
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(n, id(node) in typing_only) for n in names if n.split(".")[0] in OUR_TOPS]
    return found


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] in MAPPED:
        parts = ("llmbatch", *parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _within(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_each_package_imports_only_what_its_docstring_allows() -> None:
    wrong = []
    for package, allowed in ALLOWED.items():
        folder = ROOT / package.replace(".", "/")
        assert folder.is_dir(), package
        for path in sorted(folder.rglob("*.py")):
            for name, typing_only in _imports(path):
                ok = _within(name, allowed | {package} | EVERYWHERE) or (
                    typing_only and _within(name, TYPES_ONLY.get(package, set()))
                )
                if not ok:
                    wrong.append(f"{_module(path)} imports {name}")
    assert wrong == []


def test_llmbatch_imports_no_activities_workflows_or_workers() -> None:
    # The CLI starts workers (``llm-batch worker``): the one way up the layers.
    wrong = [
        f"{_module(path)} imports {name}"
        for path in sorted((ROOT / "llmbatch").rglob("*.py"))
        if not _module(path).startswith("llmbatch.cli")
        for name, _ in _imports(path)
        if _within(name, UPPER)
    ]
    assert wrong == []


def test_activities_use_the_shared_packages_not_the_api_or_the_cli() -> None:
    wrong = [
        f"{_module(path)} imports {name}"
        for path in sorted((ROOT / "activities").rglob("*.py"))
        for name, _ in _imports(path)
        if _within(
            name, {"llmbatch.api", "llmbatch.cli", "llmbatch.devstack", "llmbatch.workflows"}
        )
    ]
    assert wrong == []


def _loaded(*modules: str) -> list[str]:
    script = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    return list(json.loads(done.stdout))


def test_the_engine_interface_and_the_ledger_come_without_vllm() -> None:
    """The activity's engine interface is no vLLM (a remote engine lands beside it), and
    the ledger is Postgres only: neither pulls in vLLM, torch or boto3."""
    loaded = _loaded("llmbatch.engine.base", "llmbatch.ledger", "llmbatch.dedup.keys")
    assert [m for m in loaded if m.split(".")[0] in ("vllm", "torch", "boto3")] == []


def test_the_remote_worker_comes_without_vllm_or_torch() -> None:
    """``llm-batch worker remote`` needs the network and a key, not an engine: importing
    its module (and the remote engine, and its prompt-token estimate) loads no vLLM,
    torch or transformers, which took ~10 s before the worker started."""
    loaded = _loaded("llmbatch.workers.remote", "llmbatch.remote.engine", "llmbatch.remote.tokens")
    assert [m for m in loaded if m.split(".")[0] in ("vllm", "torch", "transformers")] == []


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """A circle of imports in ``graph`` (module -> the modules it imports), or []."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        for dep in sorted(graph[module]):
            if found := visit(dep, [*path, module]):
                return found
        done.add(module)
        return []

    for module in sorted(graph):
        if found := visit(module, []):
            return found
    return []


def test_the_modules_of_each_package_import_no_circle() -> None:
    """Within a package too, imports run one way (type-checking imports included), so
    no module needs another that needs it back: contract/priority.py and spec.py did."""
    for package in ALLOWED:
        folder = ROOT / package.replace(".", "/")
        graph = {
            _module(path): {
                name.rsplit(".", 1)[0] if name.rsplit(".", 1)[0] != package else name
                for name, _ in _imports(path)
            }
            for path in folder.rglob("*.py")
        }
        graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
        assert _circle(graph) == [], package


def test_the_reference_pages_import_nothing_of_the_cli() -> None:
    """``llm-batch docs`` imports the reference package and hands it the command tree;
    the reference importing the CLI's app back made a circle (cli/docs.py <->
    reference/cli.py)."""
    wrong = [
        f"{_module(path)} imports {name}"
        for path in sorted((ROOT / "llmbatch" / "reference").rglob("*.py"))
        for name, _ in _imports(path)
        if _within(name, {"llmbatch.cli"})
    ]
    assert wrong == []


def test_the_packages_and_the_layers_above_them_import_no_circle() -> None:
    """Across packages as well: no module of the packages the table holds, nor of
    ``activities``, ``workers`` and ``workflows``, needs one that needs it back
    (type-checking imports included). dedup/coordination.py and
    generation/recorder.py once did, dedup calling back into the recorder."""
    folders = [ROOT / p.replace(".", "/") for p in ALLOWED] + [ROOT / m for m in MAPPED]
    paths = [path for folder in folders for path in folder.rglob("*.py")]
    modules = {_module(path) for path in paths}

    def target(name: str) -> str:
        # ``from llmbatch.dedup import leads`` is the module leads; ``from
        # llmbatch.dedup.leads import take_leads`` is that module too.
        return name if name in modules else name.rsplit(".", 1)[0]

    graph = {_module(path): {target(name) for name, _ in _imports(path)} for path in paths}
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    assert _circle(graph) == []
