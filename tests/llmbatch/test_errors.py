"""One root for llm-batch's errors: every exception class that any module of llmbatch
defines (llmbatch.workflows, .activities and .workers included) descends from
:class:`llmbatch.errors.LlmBatchError`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmbatch.errors import LlmBatchError

# Imports every module of the installed package in a fresh interpreter (vLLM among
# them), then walks Exception's subclasses: classes defined anywhere in a module, not
# only at its top, are found, and this test process imports none of it.
_WALK = """
import importlib, json, pkgutil, sys
import llmbatch
from llmbatch.errors import LlmBatchError

names = [m.name for m in pkgutil.walk_packages(llmbatch.__path__, "llmbatch.")]
for name in names:
    importlib.import_module(name)

def subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from subclasses(sub)

ours = {
    f"{c.__module__}.{c.__qualname__}"
    for c in subclasses(Exception)
    if c.__module__ == "llmbatch" or c.__module__.startswith("llmbatch.")
}
outside = sorted(
    f"{c.__module__}.{c.__qualname__}"
    for c in subclasses(Exception)
    if f"{c.__module__}.{c.__qualname__}" in ours and not issubclass(c, LlmBatchError)
)
print(json.dumps({"modules": names, "ours": sorted(ours), "outside": outside}))
"""


# Importing every module imports vLLM and torch (20-30 s on 2 cores): the stack tier's.
@pytest.mark.slow
def test_every_llmbatch_exception_descends_from_the_root() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _WALK], capture_output=True, text=True, check=True, timeout=600
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    modules = set(found["modules"])
    # The walk reaches the folders that install as llmbatch.<name>, not only llmbatch/.
    for package in ("llmbatch.workflows", "llmbatch.activities", "llmbatch.workers"):
        assert any(m.startswith(package + ".") for m in modules), package
    assert len(found["ours"]) > 30, found["ours"]
    # A BaseException that is no Exception (the render pool's row timeout, which a
    # template's own ``except Exception`` must not swallow) is not an error class.
    assert found["outside"] == []


def test_the_root_keeps_the_builtin_bases_callers_catch_by() -> None:
    from llmbatch.rendering.templates import TemplateError
    from llmbatch.storage.base import InputNotFound
    from llmbatch.workers.shutdown import ConnectionLost

    assert issubclass(TemplateError, LlmBatchError) and issubclass(TemplateError, ValueError)
    assert issubclass(ConnectionLost, RuntimeError)
    assert issubclass(InputNotFound, LlmBatchError)
