"""An upstream service that starts llm-batch jobs knowing only the documented contract.

It stands in for a service written in another language: it imports nothing of
llm-batch (only the Temporal SDK and the standard library), connects with the SDK's
DEFAULT data converter, and sends a plain JSON object. The contract it relies on:

- workflow type ``BatchJobWorkflow`` on task queue ``llm-batch-cpu`` (the CPU queue
  setting, ``LLMBATCH_CPU_TASK_QUEUE``);
- workflow id = job id;
- input: a JobSpec as ``llm-batch schema`` describes it, bare or as ``{"spec": ...}``;
  ``job_id`` may be left out (it is then the workflow id);
- result: the job summary as a JSON object (counts, tokens, output root, manifest).

Run: ``python foreign_client.py ADDRESS NAMESPACE TASK_QUEUE WORKFLOW_ID JOB_JSON``;
prints one JSON object: ``{"result": {...}}`` or ``{"error": "..."}``, and the llm-batch
modules it had loaded (none).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from temporalio.client import Client, WorkflowFailureError

WORKFLOW_TYPE = "BatchJobWorkflow"


async def start_and_wait(
    address: str, namespace: str, task_queue: str, workflow_id: str, job: dict[str, Any]
) -> dict[str, Any]:
    """Start the job, wait for it and return its summary as a dict."""
    client = await Client.connect(address, namespace=namespace)
    handle = await client.start_workflow(
        WORKFLOW_TYPE, job, id=workflow_id, task_queue=task_queue, result_type=dict
    )
    result: dict[str, Any] = await handle.result()
    return result


def main(argv: list[str]) -> int:
    address, namespace, task_queue, workflow_id, job_json = argv
    try:
        outcome: dict[str, Any] = {
            "result": asyncio.run(
                start_and_wait(address, namespace, task_queue, workflow_id, json.loads(job_json))
            )
        }
    except WorkflowFailureError as exc:
        cause: BaseException = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        outcome = {"error": str(cause)}
    outcome["llmbatch_modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "llmbatch")
    print(json.dumps(outcome))
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    # Leave without interpreter teardown: the Temporal SDK's native runtime can crash
    # the process at exit after its work is done (SIGSEGV / "PyGILState_Release",
    # temporalio/sdk-python#300), as llm-batch's own CLI also avoids.
    sys.stdout.flush()
    os._exit(status)
