"""A job's place in the task queues: its priority and its tenant's fair share.

Temporal's task queues order backlogged tasks by a priority key (1 first) and, within
one priority, share dispatch between fairness keys in proportion to their weights.
A job's :class:`~llmbatch.contract.spec.JobSpec` names its ``priority`` and its
``tenant`` (the fairness key) with an optional ``tenant_weight``; :func:`task_priority`
turns them into the one :class:`temporalio.common.Priority` that the job's workflow,
its shard workflows and every activity are given, so a shard's ``generate`` on the
GPU queue competes with its job's priority and tenant.

Pure data, safe to import in workflows.
"""

from __future__ import annotations

from typing import Protocol

from temporalio.common import Priority

# Temporal's default number of priority levels (the server's matching.priorityLevels):
# 1 runs first, 5 last.
HIGHEST_PRIORITY = 1
LOWEST_PRIORITY = 5
# What a task without a priority key gets: (1 + levels) / 2.
DEFAULT_PRIORITY = (HIGHEST_PRIORITY + LOWEST_PRIORITY) // 2
# Temporal's limits on a fairness key (64 bytes; ASCII here, so 64 characters) and
# weight (it clamps to this range).
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,63}$"
MIN_TENANT_WEIGHT = 0.001
MAX_TENANT_WEIGHT = 1000.0


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
