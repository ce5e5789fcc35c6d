"""The custom search attributes jobs carry, so operators can filter them in the Web UI."""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

JOB_ID = SearchAttributeKey.for_keyword("JobId")
MODEL = SearchAttributeKey.for_keyword("Model")
ITEMS_TOTAL = SearchAttributeKey.for_int("ItemsTotal")
ITEMS_DONE = SearchAttributeKey.for_int("ItemsDone")
ITEMS_DEAD = SearchAttributeKey.for_int("ItemsDead")
# Set only on jobs whose spec names them (llmbatch.contract.priority); "JobPriority",
# not "Priority", so it can never meet a name of Temporal's own. A keyword ("1" to
# "5", which sort as the numbers do): the dev server's SQLite visibility store takes
# at most 3 Int attributes, and the item counts hold them.
JOB_PRIORITY = SearchAttributeKey.for_keyword("JobPriority")
TENANT = SearchAttributeKey.for_keyword("Tenant")

ALL = (JOB_ID, MODEL, ITEMS_TOTAL, ITEMS_DONE, ITEMS_DEAD, JOB_PRIORITY, TENANT)
