"""What travels between workflows and activities: references and counts, never rows.

Workflows import this module, so it holds pure data only (pydantic, no I/O).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Self

from pydantic import BaseModel, Field, model_validator

from llmbatch.contract.spec import InputFormat, JobSpec
from llmbatch.contract.states import BatchStatus, JobState


class TokenCounts(BaseModel):
    prompt: int = 0
    completion: int = 0

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(
            prompt=self.prompt + other.prompt, completion=self.completion + other.completion
        )


class RemoteUsage(BaseModel):
    """What a job's (or shard's) requests did on remote endpoints: requests sent, those
    refused with 429/503 and those sent again, tokens and their cost at the endpoints'
    prices, and two request-second sums: waiting for the shared rate budget (and the
    backoff after a 429) and waiting on the server. The larger says what bounds the
    job: its rate limits, or the server behind the endpoint."""

    requests: int = 0
    throttled: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    rate_wait_s: float = 0.0
    server_s: float = 0.0

    def __add__(self, other: RemoteUsage) -> RemoteUsage:
        return RemoteUsage(
            **{name: getattr(self, name) + getattr(other, name) for name in type(self).model_fields}
        )

    @property
    def rate_share(self) -> float:
        """The share of the requests' waiting that was for the rate budget (0 to 1)."""
        waited = self.rate_wait_s + self.server_s
        return self.rate_wait_s / waited if waited > 0 else 0.0

    @property
    def bound(self) -> str:
        """``rate-bound`` when requests waited more for the budget than on the server."""
        return "rate-bound" if self.rate_share > 0.5 else "engine-bound"

    def per_item(self, items: int) -> float | None:
        return self.cost_usd / items if items else None

    def describe(self, items: int) -> str:
        """One line for ``status`` and the Web UI's details line."""
        per = self.per_item(items)
        return (
            f"endpoint: {self.requests} requests, {self.throttled} refused with 429/503, "
            f"{self.retries} sent again; {self.bound} ({self.rate_share:.0%} of waiting was "
            f"for the rate budget); ${self.cost_usd:.4f} so far"
            + (f", ${per:.6f} per item" if per is not None else "")
        )


class Usage(BaseModel):
    """Where a job's results came from, and what its engine work cost.

    ``generated`` items were run by the engine, ``deduplicated`` ones share the result
    of another item of the job with the same request, ``cached`` ones were answered by
    an earlier job's result; ``reused_tokens`` are the token counts of the last two,
    which no engine spent. ``gpu_seconds`` is the engines' busy time on the job (per
    shard, summed) times their GPUs; ``cost`` is its price where workers have one set.
    """

    generated: int = 0
    deduplicated: int = 0
    cached: int = 0
    reused_tokens: TokenCounts = Field(default_factory=TokenCounts)
    engine_requests: int = 0
    gpu_seconds: float = 0.0
    cost: float | None = None
    remote: RemoteUsage | None = None  # None: no remote endpoint served the job

    def __add__(self, other: Usage) -> Usage:
        cost = (
            None
            if self.cost is None and other.cost is None
            else ((self.cost or 0.0) + (other.cost or 0.0))
        )
        return Usage(
            generated=self.generated + other.generated,
            deduplicated=self.deduplicated + other.deduplicated,
            cached=self.cached + other.cached,
            reused_tokens=self.reused_tokens + other.reused_tokens,
            engine_requests=self.engine_requests + other.engine_requests,
            gpu_seconds=self.gpu_seconds + other.gpu_seconds,
            cost=cost,
            remote=(
                None
                if self.remote is None and other.remote is None
                else (self.remote or RemoteUsage()) + (other.remote or RemoteUsage())
            ),
        )

    @property
    def reused(self) -> int:
        return self.deduplicated + self.cached

    @property
    def gpu_seconds_saved(self) -> float:
        """The GPU time the reused items would have taken at this job's own measured
        rate (GPU-seconds per generated item)."""
        if not self.generated:
            return 0.0
        return self.reused * self.gpu_seconds / self.generated

    def cost_per_1000(self, items: int) -> float | None:
        """Cost per 1,000 finished items, where a price is set."""
        if self.cost is None or not items:
            return None
        return self.cost * 1000.0 / items

    def describe(self) -> str:
        """One line for the CLI and the Web UI's details line: sources, GPU time, cost."""
        line = (
            f"{self.generated} generated, {self.deduplicated} deduplicated, {self.cached} "
            f"cached; {self.engine_requests} engine requests; GPU {self.gpu_seconds:.1f} s"
        )
        if self.reused and self.generated:
            line += f" ({self.gpu_seconds_saved:.1f} s saved)"
        if self.reused:
            reused = self.reused_tokens
            line += f"; tokens reused {reused.prompt} prompt, {reused.completion} completion"
        if self.cost is not None:
            line += f"; cost {self.cost:.4f}"
            per = self.cost_per_1000(self.generated + self.reused)
            if per is not None:
                line += f" ({per:.4f} per 1,000 items)"
        if self.remote is not None:
            line += f"; {self.remote.describe(self.generated + self.reused)}"
        return line


class JobLayout(BaseModel):
    """Where a job's objects live; every key is derived, so retries find the same ones."""

    job_id: str
    output_root: str = Field(description="<output_uri>/<job_id>")
    input_format: InputFormat

    @property
    def staging(self) -> str:
        return f"{self.output_root}/_staging"

    def shard_plan(self, shard: int) -> str:
        # Not under staging: a dead-letter re-drive reads the plan after the job ended.
        return f"{self.output_root}/_plans/shard-{shard:05d}.json"

    def shard_rows(self, shard: int) -> str:
        return f"{self.staging}/shard-{shard:05d}/rows.jsonl"

    def shard_requests(self, shard: int) -> str:
        return f"{self.staging}/shard-{shard:05d}/requests.jsonl"

    def output_part(self, shard: int, extension: str) -> str:
        return f"{self.output_root}/part-{shard:05d}.{extension}"

    def vectors(self, shard: int, name: str) -> str:
        """An object of an embed job's vectors. Not under staging (which goes when the
        job ends): the ledger points here, and a re-drive rewrites a shard's output
        from it."""
        return f"{self.vectors_folder(shard)}/{name}.f32"

    def vectors_folder(self, shard: int) -> str:
        return f"{self.output_root}/_vectors/shard-{shard:05d}"

    def error_part(self, shard: int) -> str:
        return f"{self.output_root}/errors/part-{shard:05d}.jsonl"

    @property
    def manifest(self) -> str:
        return f"{self.output_root}/manifest.json"


# --- BatchJobWorkflow ------------------------------------------------------------------


class PlanResult(BaseModel):
    layout: JobLayout
    shard_count: int
    items_total: int
    gpu_task_queue: str = Field(description="Queue of the workers that have the job's model.")
    generate_schedule_to_start: timedelta | None = Field(
        default=None,
        description="How long generate waits for a worker on gpu_task_queue (None: no limit); "
        "from the planning worker's settings, which workflows cannot read.",
    )
    priority_aging: timedelta | None = Field(
        default=None,
        description="A generate step waiting this long is queued again one priority "
        "level higher (None: no aging); the planning worker's Settings.priority_aging.",
    )
    progress_every: timedelta | None = Field(
        default=None,
        description="How often the job's search attributes and details line take what its "
        "running shards have recorded (None: only when a shard ends, as plans from before "
        "had it); the planning worker's Settings.progress_every.",
    )


class JobProgress(BaseModel):
    """Answer to the ``progress`` query; also the base of the final summary."""

    job_id: str
    model: str
    state: JobState = JobState.PLANNING
    shards_total: int = 0
    shards_done: int = 0
    shards_running: list[int] = Field(default_factory=list)
    items_total: int = 0
    items_succeeded: int = 0
    items_dead: int = 0
    tokens: TokenCounts = Field(default_factory=TokenCounts)
    started_at: str | None = None
    failed_shards: list[int] = Field(default_factory=list)
    paused: bool = Field(default=False, description="Paused by the pause update.")
    usage: Usage = Field(
        default_factory=Usage, description="Result sources, GPU time and cost so far."
    )
    priority: int | None = Field(
        default=None, description="The spec's task-queue priority; None: Temporal's default."
    )
    tenant: str | None = Field(default=None, description="The spec's tenant (fairness key).")
    running_items: dict[int, ShardCounts] = Field(
        default_factory=dict,
        description="What each shard still running had recorded in the ledger when last "
        "read (by shard); items_succeeded, items_dead and tokens include it, so they move "
        "as items are recorded, not only when a shard ends.",
    )

    @property
    def items_done(self) -> int:
        return self.items_succeeded + self.items_dead

    def with_running_items(self, counts: Mapping[int, ShardCounts]) -> Self:
        """A copy that has taken ``counts`` (see :meth:`take_running_items`)."""
        copy = self.model_copy(deep=True)
        copy.take_running_items(counts)
        return copy

    def take_running_items(self, counts: Mapping[int, ShardCounts]) -> None:
        """Take ``counts`` (a fresh ledger reading of shards, by number) for the shards
        still running, in place of what was read of them before; a shard that has ended
        since keeps its report, one missing from ``counts`` what was read of it."""
        for counted in self.running_items.values():
            self._uncount(counted)
        running: dict[int, ShardCounts] = {}
        for shard in self.shards_running:
            taken = counts.get(shard, self.running_items.get(shard))
            if taken is not None:
                running[shard] = taken
                self.items_succeeded += taken.succeeded
                self.items_dead += taken.dead
                self.tokens = self.tokens + taken.tokens
        self.running_items = running

    def count_shard_report(self, report: ShardSummary) -> None:
        """Count a shard's final report in place of what was read of it running."""
        self._uncount(self.running_items.pop(report.shard, None))
        self.shards_done += 1
        self.items_succeeded += report.succeeded
        self.items_dead += report.dead
        self.tokens = self.tokens + report.tokens
        self.usage = self.usage + report.usage

    def _uncount(self, counts: ShardCounts | None) -> None:
        if counts is not None:
            self.items_succeeded -= counts.succeeded
            self.items_dead -= counts.dead
            self.tokens = TokenCounts(
                prompt=self.tokens.prompt - counts.tokens.prompt,
                completion=self.tokens.completion - counts.tokens.completion,
            )


class JobSummary(JobProgress):
    output_root: str = ""
    manifest: str = ""
    finished_at: str | None = None
    elapsed_s: float = 0.0


def final_state(summary: JobProgress) -> JobState:
    """How a job ended: ``succeeded`` (nothing dead), ``completed_with_errors`` (some
    items dead or a shard's output part missing), ``failed`` (no item succeeded)."""
    if summary.items_total and summary.items_succeeded == 0:
        return JobState.FAILED
    if summary.items_dead or summary.failed_shards:
        return JobState.COMPLETED_WITH_ERRORS
    return JobState.SUCCEEDED


class FinalizeInput(BaseModel):
    spec: JobSpec
    layout: JobLayout
    summary: JobSummary


class BatchJobState(BaseModel):
    """Carried across continue-as-new so a job of any size keeps a short history."""

    plan: PlanResult | None = None
    next_shard: int = 0
    progress: JobProgress | None = None
    finished: list[ShardSummary] = Field(
        default_factory=list, description="Shard reports received but not yet counted."
    )


class BatchJobInput(BaseModel):
    """BatchJobWorkflow's input: ``{"spec": JobSpec}``, or the bare JobSpec itself (what
    ``llm-batch schema`` describes), as a service in another language may send it."""

    spec: JobSpec
    state: BatchJobState = Field(default_factory=BatchJobState)

    @model_validator(mode="before")
    @classmethod
    def _bare_spec(cls, data: Any) -> Any:
        if isinstance(data, dict) and "spec" not in data:
            return {"spec": data}
        return data


class JobPausedInput(BaseModel):
    """Input of ``set_job_paused``."""

    job_id: str
    paused: bool


class JobEndInput(BaseModel):
    """Input of ``record_job_end``: how a job ended that did not finalize."""

    job_id: str
    state: JobState
    items_total: int = 0


class ApiBatchStatusInput(BaseModel):
    """Input of ``set_api_batch_status``: an OpenAI Batch API batch's new status."""

    batch_id: str
    status: BatchStatus


class ApiBatchRecordInput(BaseModel):
    """Input of the ``create_api_batch`` update and the ``record_api_batch`` activity:
    the OpenAI Batch API batch's record (``api_batches`` row) as its workflow writes it."""

    batch_id: str
    project: str
    input_file_id: str
    endpoint: str
    completion_window: str
    window_s: int
    model: str
    metadata: dict[str, str] | None = None
    max_in_progress: int


class ApiBatchEndInput(BaseModel):
    """Input of ``finish_api_batch``: how the batch ends (completed, expired or
    cancelled); requests not finished by then stop and go to the error file."""

    spec: JobSpec
    layout: JobLayout
    status: BatchStatus


class ApiBatchFiles(BaseModel):
    """What ``finish_api_batch`` made: the files' ids (None: no such lines) and how
    many requests each holds."""

    output_file_id: str | None = None
    error_file_id: str | None = None
    succeeded: int = 0
    failed: int = 0
    tokens: TokenCounts = Field(default_factory=TokenCounts)


class JobControlState(BaseModel):
    """What the pause and resume updates answer: the job's state after the call."""

    job_id: str
    state: JobState
    paused: bool


# --- ShardWorkflow ---------------------------------------------------------------------


class ShardInput(BaseModel):
    spec: JobSpec
    layout: JobLayout
    shard: int
    gpu_task_queue: str
    generate_schedule_to_start: timedelta | None = Field(
        default=None, description="See PlanResult.generate_schedule_to_start."
    )
    priority_aging: timedelta | None = Field(
        default=None, description="See PlanResult.priority_aging."
    )
    parent_workflow_id: str | None = Field(
        default=None, description="Job workflow to signal when done; None: just return."
    )
    prepare_first: bool = Field(
        default=False,
        description="The shard's first step is prepare_shard, as its starter knows: no "
        "patch marker needed (False: decided by workflow.patched, as before this field).",
    )
    redrive: int = Field(default=0, description="Re-drive number; 0 for the job's own run.")
    sampling_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Re-drive: sampling fields that replace the items'."
    )


class FetchResult(BaseModel):
    rows: int
    invalid: int


class RenderResult(BaseModel):
    to_generate: int
    already_done: int
    dead: int


class PrepareResult(FetchResult, RenderResult):
    """``prepare_shard``: the rows it read and what became of them."""

    summary: ShardSummary | None = Field(
        default=None,
        description="A shard with nothing left to generate (every row answered or dead) "
        "has its output part written by prepare_shard itself: this is then what "
        "write_shard would have returned, and the shard has no write step.",
    )


class GenerateProgress(BaseModel):
    """Heartbeat details of ``generate``: how far the attempt got."""

    recorded: int = 0
    dead: int = 0


class GenerateResult(BaseModel):
    generated: int
    dead: int
    skipped: int
    tokens: TokenCounts


class ShardCounts(BaseModel):
    """A shard's items by outcome, as the ledger has them."""

    succeeded: int
    dead: int
    tokens: TokenCounts
    marked: int = Field(default=0, description="Dead items that this call marked dead.")


class RunningItemsInput(BaseModel):
    """Input of ``count_running_items``: a job and the shards it runs."""

    job_id: str
    shards: list[int]


class RunningItems(BaseModel):
    """What ``count_running_items`` answers: each running shard's counts so far."""

    shards: dict[int, ShardCounts] = Field(default_factory=dict)


class ShardSummary(BaseModel):
    """What a shard reports to its parent when it ends."""

    shard: int
    items: int = 0
    succeeded: int = 0
    dead: int = 0
    tokens: TokenCounts = Field(default_factory=TokenCounts)
    output_parts: list[str] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    failed: str | None = Field(default=None, description="Why the shard itself failed, if it did.")


JobProgress.model_rebuild()
JobSummary.model_rebuild()
RunningItems.model_rebuild()
BatchJobState.model_rebuild()
PrepareResult.model_rebuild()
