"""Names of workflows, activities, signals, queries and updates, and workflow ids;
and the naming rules of models (:func:`model_identity`, :func:`model_slug`).

Workflows call activities by these names, so they never import the modules that
hold boto3, asyncpg or vLLM; callers in other languages use them too.
"""

from __future__ import annotations

import functools
import hashlib
import re

# Workflow types.
BATCH_JOB_WORKFLOW = "BatchJobWorkflow"
SHARD_WORKFLOW = "ShardWorkflow"
DEAD_LETTER_WORKFLOW = "DeadLetterWorkflow"

# Activities.
PLAN_JOB = "plan_job"
# A shard's first step: read its rows, render them, register them in the ledger (also
# the patch id under which ShardWorkflow runs it).
PREPARE_SHARD = "prepare_shard"
# The two steps prepare_shard replaced, still run by shards started before it existed.
FETCH_SHARD = "fetch_shard"
RENDER_PROMPTS = "render_prompts"
GENERATE = "generate"
WRITE_SHARD = "write_shard"
FINALIZE_JOB = "finalize_job"
# Running `generate` activities cannot receive signals, so pause and resume reach
# them through the ledger's jobs row, written by this activity.
SET_JOB_PAUSED = "set_job_paused"
# A cancelled or failed job never reaches finalize_job; this records its end state
# in the ledger's jobs row instead, so the row does not stay "running".
RECORD_JOB_END = "record_job_end"
# An OpenAI Batch API batch (JobSpec.api_batch): its status in api_batches, and its
# end (output and error files assembled and registered, the final status). Also the
# patch id of the workflow code that calls them.
SET_API_BATCH_STATUS = "set_api_batch_status"
FINISH_API_BATCH = "finish_api_batch"
# The batch's record (api_batches row), written by its own workflow: the API server
# starts the workflow and asks it for the record in one Update-with-Start, so no record
# exists without a workflow that ends it. Also the patch id of the workflow code that
# waits for it.
RECORD_API_BATCH = "record_api_batch"
# What a job's running shards have recorded so far, read from the ledger at a
# bounded rate (PlanResult.progress_every) for the job's search attributes.
COUNT_RUNNING_ITEMS = "count_running_items"
FAIL_SHARD = "fail_shard"
REPORT_DEAD_LETTERS = "report_dead_letters"
REQUEUE_DEAD_LETTERS = "requeue_dead_letters"

# BatchJobWorkflow's handlers.
SHARD_FINISHED_SIGNAL = "shard_finished"
# Also the patch id of the job workflow code under which shards report by their
# result, not by signal (workflows.batch_job).
SHARD_RESULTS = "shard_results"
PROGRESS_QUERY = "progress"
PAUSE_UPDATE = "pause"
RESUME_UPDATE = "resume"
CREATE_API_BATCH_UPDATE = "create_api_batch"

# ShardWorkflow's handler: report to the job by signal after all (the job workflow is
# about to continue as new, and a child's result would reach only the run it ends).
REPORT_BY_SIGNAL = "report_by_signal"

# DeadLetterWorkflow's handlers.
DEAD_LETTERS_SIGNAL = "dead_letters"
JOB_FINISHED_SIGNAL = "job_finished"
DEAD_LETTERS_QUERY = "dead_letters"
REDRIVE_UPDATE = "redrive"


def shard_workflow_id(job_id: str, shard: int) -> str:
    """A job's own run of a shard (its parent is the job's workflow, id = job id)."""
    return f"{job_id}/shard-{shard:05d}"


def redrive_shard_workflow_id(job_id: str, redrive: int, shard: int) -> str:
    """A dead-letter re-drive's run of a shard."""
    return f"{job_id}/redrive-{redrive}/shard-{shard:05d}"


def shard_of(workflow_id: str) -> int | None:
    """The shard a shard workflow id (either kind above) runs, or None."""
    _, _, last = workflow_id.rpartition("/shard-")
    return int(last) if last.isdigit() else None


def dead_letter_workflow_id(job_id: str) -> str:
    return f"{job_id}/dlq"


# --- models ----------------------------------------------------------------------

# The slug keeps a queue name readable; the hash of the full id keeps it unique, so
# '/a/Model' and '/b/model' (or 'Org/M' and 'org-m') never share a queue.
MODEL_HASH_CHARS = 10
MODEL_SLUG_CHARS = 80


# How a model given as a local path starts: absolute, explicitly relative, or in a
# home folder. 'org/name' is a Hugging Face id, not a path.
_PATH_PREFIXES = ("/", "./", "../", "~")
# Hex characters of the path's hash in a path's name: tells apart two folders of the
# same name ('/a/tiny', '/b/tiny'), which may hold different weights.
PATH_NAME_HASH_CHARS = 8


def model_id(model: str) -> str:
    """A model's id as given, without trailing slashes ('/m/' and '/m' name one model):
    how an endpoint's model is named, where the id is the endpoint's to interpret (a
    path there is the remote server's, sent to it unchanged)."""
    return model.rstrip("/") or model


# Asked for every line of an OpenAI batch file (its body.model): a hash, worked out once.
@functools.lru_cache(maxsize=1024)
def model_identity(model: str) -> str:
    """The model as jobs, workers and the OpenAI API name and compare it.

    A model id is itself, without trailing slashes ('/m/' and '/m' name one model).
    A local path is its folder's name and a hash of the whole path as given
    ('/models/tiny' -> 'tiny-1c3e9a0b'), so ``GET /v1/models`` never shows a server
    path and a batch can name the model by what it lists, while two folders of the
    same name stay two models. Paths are not resolved: the machine that names a
    model need not be the one that loads it, so both must spell the path alike (or
    give the worker vLLM's ``--served-model-name`` and use that name).
    """
    given = model_id(model)
    if not given.startswith(_PATH_PREFIXES) or given == "/":
        return given
    digest = hashlib.sha256(given.encode()).hexdigest()[:PATH_NAME_HASH_CHARS]
    return f"{given.rsplit('/', 1)[-1] or 'model'}-{digest}"


def model_slug(model: str) -> str:
    """A readable, task-queue-safe form of the whole model id or path (the end of a
    long one, which tells models apart better than a shared prefix)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_identity(model)).strip("-.").lower()
    return slug[-MODEL_SLUG_CHARS:].lstrip("-.") or "model"
