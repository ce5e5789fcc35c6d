"""A job's place in the task queues: its priority and its tenant's fair share.

Temporal's task queues order backlogged tasks by a priority key (1 first) and, within
one priority, share dispatch between fairness keys in proportion to their weights.
A job's :class:`~llmbatch.contract.spec.JobSpec` names its ``priority`` and its
``tenant`` (the fairness key) with an optional ``tenant_weight``; :func:`task_priority`
turns them into the one :class:`temporalio.common.Priority` that the job's workflow,
its shard workflows and every activity are given, so a shard's ``generate`` on the
GPU queue competes with its job's priority and tenant.

Two rules keep this fair (see "Priorities and tenants" in the docs): a step that waits
long is aged one level up (:func:`aged`), so waiting work has a bounded wait, and an
operator's :class:`TenantQuota` caps the priority, weight and number of jobs a tenant
may ask for (:func:`quota_refusal`), checked where jobs are submitted.

Pure data, safe to import in workflows.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field
from temporalio.common import Priority

from llmbatch.contract.choices import DEFAULT_PRIORITY, HIGHEST_PRIORITY, LOWEST_PRIORITY

# Temporal's limits on a fairness key (64 bytes; ASCII here, so 64 characters) and
# weight (it clamps to this range).
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,63}$"
MIN_TENANT_WEIGHT = 0.001
MAX_TENANT_WEIGHT = 1000.0
# The quota entry (Settings.tenant_quotas) of every tenant that has none of its own.
ANY_TENANT = "*"


class Prioritized(Protocol):
    """What priority reads of a job spec (a :class:`~llmbatch.contract.spec.JobSpec` is
    one). A protocol, so this module needs nothing of spec.py, which imports it."""

    @property
    def priority(self) -> int | None: ...

    @property
    def tenant(self) -> str | None: ...

    @property
    def tenant_weight(self) -> float | None: ...


def task_priority(spec: Prioritized) -> Priority:
    """The task-queue priority of ``spec``'s workflows and activities.

    Fields the spec leaves out stay unset, which Temporal reads as "inherit from the
    calling workflow, else the default" (priority 3, no tenant, weight 1): a spec
    without them gives exactly the options jobs had before these fields existed.
    """
    return Priority(
        priority_key=spec.priority,
        fairness_key=spec.tenant,
        fairness_weight=spec.tenant_weight,
    )


def describe(spec: Prioritized) -> str:
    """'priority 1, tenant team-a (weight 2)' for the Web UI's lines; '' when the spec
    sets neither (the job runs at the default priority, without a tenant)."""
    parts = []
    if spec.priority is not None:
        parts.append(f"priority {spec.priority}")
    if spec.tenant is not None:
        weight = f" (weight {spec.tenant_weight:g})" if spec.tenant_weight is not None else ""
        parts.append(f"tenant {spec.tenant}{weight}")
    return ", ".join(parts)


def aged(priority_key: int | None, *, levels: int) -> int:
    """The priority key of a step that has waited ``levels`` aging intervals: one
    level higher each time (a smaller key), never above :data:`HIGHEST_PRIORITY`.

    Aging ignores the tenant's quota on purpose: only reaching priority 1 bounds the
    wait of a job behind a steady stream of priority-1 work.
    """
    start = DEFAULT_PRIORITY if priority_key is None else priority_key
    return max(HIGHEST_PRIORITY, start - levels)


class TenantQuota(BaseModel):
    """What an operator lets one tenant (an API project, a CLI job's ``--tenant``)
    ask for. Unset fields cap nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    highest_priority: int = Field(
        default=HIGHEST_PRIORITY,
        ge=HIGHEST_PRIORITY,
        le=LOWEST_PRIORITY,
        description="The most urgent priority its jobs may ask for (1 first).",
    )
    max_weight: float = Field(
        default=MAX_TENANT_WEIGHT,
        ge=MIN_TENANT_WEIGHT,
        le=MAX_TENANT_WEIGHT,
        description="The largest tenant_weight its jobs may ask for.",
    )
    max_concurrent_jobs: int | None = Field(
        default=None, ge=1, description="Its jobs that may run at once (None: no cap)."
    )


def quota_refusal(spec: Prioritized, quota: TenantQuota) -> str | None:
    """Why ``spec`` asks for more than ``quota`` allows (priority or weight), or None."""
    who = f"tenant {spec.tenant}" if spec.tenant is not None else "a job without a tenant"
    if spec.priority is not None and spec.priority < quota.highest_priority:
        return (
            f"{who} may ask for priority {quota.highest_priority} at most (1 is first), "
            f"not {spec.priority}"
        )
    if spec.tenant_weight is not None and spec.tenant_weight > quota.max_weight:
        return (
            f"{who} may ask for a weight of {quota.max_weight:g} at most, "
            f"not {spec.tenant_weight:g}"
        )
    return None
