"""Operators' caps on what a tenant may ask for (Settings.tenant_quotas), refused by
``submit`` on the real stack (Temporal's visibility counts the running jobs)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from temporalio.client import Client

from llmbatch.client.quotas import running_jobs
from llmbatch.config import Settings
from llmbatch.contract.priority import ANY_TENANT, TenantQuota
from tests.llmbatch.cli.test_jobs import cli


async def test_submit_refuses_what_the_tenant_quota_does_not_allow(
    stack: Settings, temporal_client: Client, tmp_path: Path
) -> None:
    team = f"team-{uuid.uuid4().hex[:6]}"
    # No worker polls this queue: a submitted job stays running, holding its place.
    settings = stack.model_copy(
        update={
            "cpu_task_queue": f"quota-{uuid.uuid4().hex[:8]}",
            "tenant_quotas": {
                team: TenantQuota(highest_priority=3, max_weight=2, max_concurrent_jobs=1),
                ANY_TENANT: TenantQuota(highest_priority=4),
            },
        }
    )
    data = tmp_path / "rows.csv"
    data.write_text("name\nAcme\n")
    base = ["submit", "--input", str(data), "--model", "m", "--user", "{{ name }}"]

    code, _, err = await cli(settings, *base, "--tenant", team, "--priority", "1")
    assert code == 1 and f"tenant {team} may ask for priority 3 at most" in err, err
    assert "LLMBATCH_TENANT_QUOTAS" in err
    code, _, err = await cli(settings, *base, "--tenant", team, "--tenant-weight", "5")
    assert code == 1 and "weight of 2 at most, not 5" in err, err
    # A tenant the operator did not name gets the "*" entry; so do jobs without one.
    code, _, err = await cli(settings, *base, "--tenant", f"{team}-x", "--priority", "3")
    assert code == 1 and "may ask for priority 4 at most" in err, err
    code, _, err = await cli(settings, *base, "--priority", "2")
    assert code == 1 and "a job without a tenant may ask for priority 4" in err, err

    first = f"quota-{uuid.uuid4().hex[:8]}"
    code, _, err = await cli(
        settings, *base, "--tenant", team, "--priority", "3", "--job-id", first
    )
    assert code == 0, err
    try:
        # Visibility records a started job within moments.
        for _ in range(100):
            if await running_jobs(temporal_client, tenant=team, excluding="") == 1:
                break
            await asyncio.sleep(0.1)
        code, _, err = await cli(settings, *base, "--tenant", team, "--job-id", f"{first}-2")
        assert code == 1 and f"tenant {team} may run 1 jobs at once and runs 1" in err, err
        # Submitting the running job again follows it: it takes no second place.
        code, _, err = await cli(
            settings, *base, "--tenant", team, "--priority", "3", "--job-id", first
        )
        assert code == 0, err
    finally:
        await temporal_client.get_workflow_handle(first).terminate("test over")
