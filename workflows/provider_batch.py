"""ProviderBatchWorkflow: one shard's requests as a provider batch, waited for durably.

A child of the shard's workflow (id ``<job>/shard-<n>/provider-batch``). It submits
the batch (recorded before any wait), then sleeps on workflow timers between short
status checks, the gaps growing with the batch's age, so hours of waiting hold no
worker slot. A completed batch's answers are recorded; an expired one is submitted
again for what it left, up to a limit, then its rest is dead-lettered as expired; a
failed (refused) one dead-letters its lines with the provider's errors. Cancelled,
it cancels the provider batch and gives its items back.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from llmbatch.contract.messages import ShardInput
    from llmbatch.contract.provider import (
        MAX_RESUBMISSIONS,
        PROVIDER_BATCH_WORKFLOW,
        PROVIDER_CANCEL,
        PROVIDER_CANCEL_IN_SUBMIT,
        PROVIDER_CHECK,
        PROVIDER_COLLECT,
        PROVIDER_GIVE_UP,
        PROVIDER_RELEASE_SLOT,
        PROVIDER_SUBMIT,
        PROVIDER_TAKE_SLOT,
        TERMINAL,
        ProviderBatchRef,
        ProviderBatchState,
        ProviderGiveUp,
        ProviderSubmit,
    )
    from llmbatch.contract.states import BatchStatus, ErrorClass

from llmbatch.workflows import options

# Status checks: the first soon after creation (small batches finish in seconds), then
# every tenth of the batch's age, never more often than FIRST_CHECK nor less often
# than MAX_CHECK_GAP (a 24-hour batch costs a few hundred checks).
FIRST_CHECK = timedelta(seconds=1)
MAX_CHECK_GAP = timedelta(minutes=10)
# Tries for a free slot of the endpoint's --batch-max-in-flight: every tenth of the wait
# so far, at most a minute apart (a day's wait costs ~1,500 tries, far below the
# history's limit), so a freed slot is taken soon.
MAX_SLOT_GAP = timedelta(minutes=1)


@workflow.defn(name=PROVIDER_BATCH_WORKFLOW)
class ProviderBatchWorkflow:
    @workflow.run
    async def run(self, input: ShardInput) -> None:
        spec, shard = input.spec, input.shard
        submission = 0
        while True:
            slot = ProviderSubmit(shard=input, submission=submission)
            # Histories from before --batch-max-in-flight was enforced replay without it.
            with_slot = workflow.patched(PROVIDER_TAKE_SLOT)
            try:
                if with_slot:
                    await self._take_slot(slot)
                # Histories from before the shield replay the step unshielded.
                ref = await self._submit(slot, shielded=workflow.patched(PROVIDER_CANCEL_IN_SUBMIT))
                if ref.batch_id is None:
                    return  # nothing to send: every item done, shared or cached
                try:
                    state = await self._wait(ref)
                except asyncio.CancelledError:
                    await self._cancel(ref)
                    raise
            finally:
                # The batch ended, was cancelled or never started (a wait cancelled, a
                # step failed for good): its slot goes to the next shard waiting.
                if with_slot:
                    await workflow.execute_activity(
                        PROVIDER_RELEASE_SLOT,
                        slot,
                        **options.ledger_step(
                            summary=f"shard {shard}: release provider batch slot"
                        ),
                    )
            if state.status in (
                BatchStatus.COMPLETED,
                BatchStatus.EXPIRED,
                BatchStatus.CANCELLED,
            ):
                # An expired or cancelled batch keeps what it finished in its files.
                await workflow.execute_activity(
                    PROVIDER_COLLECT,
                    ref,
                    **options.cpu_step(spec, summary=f"record provider batch {ref.batch_id}"),
                )
            if state.status is BatchStatus.EXPIRED and submission < MAX_RESUBMISSIONS:
                submission += 1
                continue
            await self._give_up(ref, state)
            return

    async def _take_slot(self, slot: ProviderSubmit) -> None:
        """Wait, on timers, until the submission holds one of the endpoint's slots."""
        started = workflow.now()
        endpoint = slot.shard.spec.remote_endpoint
        while not await workflow.execute_activity(
            PROVIDER_TAKE_SLOT,
            slot,
            result_type=bool,
            **options.ledger_step(
                summary=f"shard {slot.shard.shard}: take a provider batch slot",
                spec=slot.shard.spec,
            ),
        ):
            waited = workflow.now() - started
            workflow.set_current_details(
                f"waiting {int(waited.total_seconds())} s for a provider batch slot: endpoint "
                f"{endpoint} has as many batches in flight as its --batch-max-in-flight"
            )
            await workflow.sleep(min(MAX_SLOT_GAP, max(FIRST_CHECK, waited / 10)))

    async def _submit(self, slot: ProviderSubmit, *, shielded: bool) -> ProviderBatchRef:
        """Submit the batch; ``shielded``, a cancel that comes while it is being created
        lets the step finish, and the batch it created is cancelled. Cancelled with the
        step, that batch was left running at the provider, and billed."""
        shard = slot.shard
        submit = workflow.start_activity(
            PROVIDER_SUBMIT,
            slot,
            result_type=ProviderBatchRef,
            **options.cpu_step(shard.spec, summary=f"shard {shard.shard}: submit provider batch"),
        )
        if not shielded:
            return await submit
        try:
            return await asyncio.shield(submit)
        except asyncio.CancelledError:
            ref = await submit
            if ref.batch_id is not None:
                await self._cancel(ref)
            raise

    async def _cancel(self, ref: ProviderBatchRef) -> None:
        await workflow.execute_activity(
            PROVIDER_CANCEL,
            ref,
            **options.ledger_step(summary=f"cancel provider batch {ref.batch_id}"),
        )

    async def _wait(self, ref: ProviderBatchRef) -> ProviderBatchState:
        started = workflow.now()
        gap = FIRST_CHECK
        while True:
            await workflow.sleep(gap)
            state: ProviderBatchState = await workflow.execute_activity(
                PROVIDER_CHECK,
                ref,
                result_type=ProviderBatchState,
                # The provider's API down for a while is waited out, not a failure.
                **options.ledger_step(
                    summary=f"check provider batch {ref.batch_id}", spec=ref.shard.spec
                ),
            )
            workflow.set_current_details(
                f"provider batch {ref.batch_id}: {state.status}, "
                f"{state.completed + state.failed}/{state.total or ref.requests} done"
            )
            if state.status in TERMINAL:
                return state
            age = workflow.now() - started
            gap = min(MAX_CHECK_GAP, max(FIRST_CHECK, age / 10))

    async def _give_up(self, ref: ProviderBatchRef, state: ProviderBatchState) -> None:
        """Dead-letter what the batch left unanswered (nothing, normally)."""
        if state.status is BatchStatus.EXPIRED:
            error_class = ErrorClass.BATCH_EXPIRED
            message = (
                f"provider batch {ref.batch_id} expired "
                f"({MAX_RESUBMISSIONS + 1} submissions) before this request ran"
            )
        elif state.status is BatchStatus.CANCELLED:
            error_class = ErrorClass.BATCH_CANCELLED
            message = f"provider batch {ref.batch_id} was cancelled before this request ran"
        elif state.status is BatchStatus.FAILED:
            error_class = ErrorClass.INVALID_REQUEST
            message = f"provider batch {ref.batch_id} failed validation: " + (
                "; ".join(state.errors) or "no reason given"
            )
        else:
            error_class = ErrorClass.SHARD_FAILED
            message = f"provider batch {ref.batch_id} completed without an answer for this request"
        await workflow.execute_activity(
            PROVIDER_GIVE_UP,
            ProviderGiveUp(ref=ref, error_class=error_class, message=message[:1000]),
            **options.ledger_step(summary=f"dead-letter what {ref.batch_id} left"),
        )
