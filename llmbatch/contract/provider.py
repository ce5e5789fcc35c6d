"""What the provider-batch workflow and its activities pass each other: ids and counts.

Workflows import this module: pure data only.
"""

from __future__ import annotations

from pydantic import BaseModel

from llmbatch.contract.messages import ShardInput
from llmbatch.contract.states import BatchStatus, ErrorClass

PROVIDER_BATCH_WORKFLOW = "ProviderBatchWorkflow"
PROVIDER_SUBMIT = "provider_batch_submit"
PROVIDER_CHECK = "provider_batch_check"
PROVIDER_COLLECT = "provider_batch_collect"
PROVIDER_GIVE_UP = "provider_batch_give_up"
PROVIDER_CANCEL = "provider_batch_cancel"
# A slot of the endpoint's --batch-max-in-flight, taken before the batch is created and
# released when it ends; PROVIDER_TAKE_SLOT is also the patch id of the workflow code
# that calls them.
PROVIDER_TAKE_SLOT = "provider_batch_take_slot"
PROVIDER_RELEASE_SLOT = "provider_batch_release_slot"
# The patch id of the workflow code that lets a submit step cancelled in flight finish,
# and cancels the batch it created.
PROVIDER_CANCEL_IN_SUBMIT = "provider_batch_cancel_in_submit"

# An expired provider batch is submitted again for what it did not finish this many
# times; then the rest is dead-lettered as expired.
MAX_RESUBMISSIONS = 2


# A provider batch's status is OpenAI's (BatchStatus); before the batch is created the
# ledger row says "preparing", and "empty" when the shard had nothing to send.
PREPARING = "preparing"
NOTHING_TO_SEND = "empty"
TERMINAL = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)


class ProviderSubmit(BaseModel):
    """Submit (or find) the shard's provider batch number ``submission``."""

    shard: ShardInput
    submission: int = 0


class ProviderBatchRef(BaseModel):
    """One provider batch of a shard, as recorded; ``batch_id`` None: nothing was sent
    (every item was done, deduplicated or cached)."""

    shard: ShardInput
    token: str
    submission: int
    lease_owner: str
    batch_id: str | None = None
    requests: int = 0


class ProviderBatchState(BaseModel):
    """What a status check found."""

    status: BatchStatus
    completed: int = 0
    failed: int = 0
    total: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[str] = []


class ProviderGiveUp(BaseModel):
    """Dead-letter what the batch left unfinished, with this reason."""

    ref: ProviderBatchRef
    error_class: ErrorClass
    message: str
