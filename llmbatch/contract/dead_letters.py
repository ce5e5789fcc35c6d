"""The messages of a job's DeadLetterWorkflow (id ``<job>/dlq``) and its activities."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel, Field

from llmbatch.contract.messages import JobLayout, JobSummary
from llmbatch.contract.spec import JobSpec
from llmbatch.contract.states import ErrorClass


class DeadLetterEntry(BaseModel):
    """A dead item, as the ledger keeps it and the dead-letter list shows it (there
    with the message cut short)."""

    item_id: str
    shard: int
    error_class: ErrorClass
    message: str
    attempts: int
    source: str | None = None


class ShardDeadLetters(BaseModel):
    """A shard's dead items as last reported; a new report replaces the old one."""

    shard: int
    by_class: dict[ErrorClass, int] = Field(default_factory=dict)
    entries: list[DeadLetterEntry] = Field(
        default_factory=list, description="Listed entries; may be fewer than the count."
    )

    @property
    def count(self) -> int:
        return sum(self.by_class.values())


class FailShardInput(BaseModel):
    job_id: str
    model: str
    shard: int
    error_class: ErrorClass
    message: str


class RequeueInput(BaseModel):
    job_id: str
    item_ids: list[str] | None = None
    error_classes: list[ErrorClass] | None = None


class RequeueResult(BaseModel):
    requeued: int
    shards: list[int]


class RedriveRequest(BaseModel):
    """What to re-drive: all dead items, or those with the given ids or error classes;
    ``sampling`` replaces sampling fields for them (e.g. a larger max_tokens), or,
    for an embed job, embed options (truncate_prompt_tokens, normalize, dimensions)."""

    item_ids: list[str] | None = None
    error_classes: list[ErrorClass] | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)


class RedriveResult(BaseModel):
    redrive: int
    requeued: int
    succeeded: int
    dead: int
    shards: list[int]


class DeadLetterState(BaseModel):
    """Carried across continue-as-new."""

    shards: dict[int, ShardDeadLetters] = Field(default_factory=dict)
    job: JobSummary | None = Field(default=None, description="The job's latest summary.")
    redrives: list[RedriveResult] = Field(default_factory=list)


class DeadLetterInput(BaseModel):
    job_id: str
    spec: JobSpec
    layout: JobLayout
    gpu_task_queue: str
    generate_schedule_to_start: timedelta | None = None
    priority_aging: timedelta | None = None
    state: DeadLetterState = Field(default_factory=DeadLetterState)


class DeadLetterView(BaseModel):
    """Answer to the ``dead_letters`` query."""

    job_id: str
    dead: int
    by_class: dict[ErrorClass, int]
    entries: list[DeadLetterEntry]
    listed_all: bool = Field(description="False when only part of the entries is listed.")
    job: JobSummary | None
    redrives: list[RedriveResult]
    redriving: bool
