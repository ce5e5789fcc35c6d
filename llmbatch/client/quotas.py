"""Operators' caps on what a tenant's jobs may ask for, checked where jobs are submitted.

``Settings.tenant_quotas`` declares them (llmbatch.contract.priority.TenantQuota);
``submit`` and ``POST /v1/batches`` call :func:`check_quota` before a job starts. A
service that starts ``BatchJobWorkflow`` over Temporal's API is trusted as an operator
(it could start any workflow) and is not capped.
"""

from __future__ import annotations

from temporalio.client import Client

from llmbatch.config import Settings
from llmbatch.contract import search_attributes as sa
from llmbatch.contract.names import BATCH_JOB_WORKFLOW
from llmbatch.contract.priority import TenantQuota, quota_refusal
from llmbatch.contract.spec import JobSpec
from llmbatch.errors import LlmBatchError

QUOTA_SETTING = "LLMBATCH_TENANT_QUOTAS"


class QuotaExceeded(LlmBatchError):
    """A job asks for more than its tenant's quota allows; the message says what."""


def _literal(value: str) -> str:
    """``value`` as a string literal of Temporal's visibility query language."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


async def running_jobs(client: Client, *, tenant: str | None, excluding: str) -> int:
    """Jobs of ``tenant`` (None: jobs without one) that run now, but ``excluding``
    (a resubmitted job id follows its running job and takes no second place)."""
    who = f"{sa.TENANT.name} = {_literal(tenant)}" if tenant else f"{sa.TENANT.name} IS NULL"
    query = (
        f"WorkflowType = {_literal(BATCH_JOB_WORKFLOW)} AND ExecutionStatus = 'Running' "
        f"AND {who} AND WorkflowId != {_literal(excluding)}"
    )
    return (await client.count_workflows(query)).count


def check_spec(spec: JobSpec, quota: TenantQuota) -> None:
    """Refuse a priority or weight beyond ``quota`` (no I/O)."""
    refusal = quota_refusal(spec, quota)
    if refusal is not None:
        raise QuotaExceeded(f"{refusal} (an operator's cap, {QUOTA_SETTING})")


async def check_quota(client: Client, settings: Settings, spec: JobSpec) -> None:
    """Raise :class:`QuotaExceeded` when ``spec`` asks for more than its tenant's quota:
    a higher priority, a larger weight, or one job more than it may run at once."""
    quota = settings.quota(spec.tenant)
    check_spec(spec, quota)
    if quota.max_concurrent_jobs is None:
        return
    running = await running_jobs(client, tenant=spec.tenant, excluding=spec.job_id)
    if running >= quota.max_concurrent_jobs:
        who = f"tenant {spec.tenant}" if spec.tenant else "jobs without a tenant"
        raise QuotaExceeded(
            f"{who} may run {quota.max_concurrent_jobs} jobs at once and runs {running}: "
            f"wait for one to finish (an operator's cap, {QUOTA_SETTING})"
        )
