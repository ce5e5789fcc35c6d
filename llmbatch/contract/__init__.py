"""The contract between llm-batch's workflows, activities, workers and callers.

Everything a workflow may import lives here, and only here: pure data and names,
no I/O, no clocks, no randomness (a test checks that workflow modules import
nothing else of llmbatch). Callers in other languages start jobs with the JSON
shape of :class:`~llmbatch.contract.spec.JobSpec` and the names in
:mod:`~llmbatch.contract.names`.

- ``spec``: what a caller sends (JobSpec and its parts).
- ``choices``: the enums of the spec's fields and the priority range, plain Python
  (no pydantic, no Temporal), for the CLI's options.
- ``states``: job states, item statuses and error classes (enums).
- ``explanations``: each error class's and failure type's cause and remedy.
- ``names``: workflow, activity, signal, query and update names; workflow ids.
- ``messages``: what travels between workflows and activities (references and
  counts, never rows).
- ``dead_letters``: the dead-letter workflow's messages.
- ``search_attributes``: the custom search attributes jobs carry.
- ``priority``: a job's task-queue priority and tenant (Temporal's ``Priority``).
- ``progress``: the one-line progress text shown in the Web UI and the CLI.
- ``states`` also holds the item state machine (``ITEM_TRANSITIONS``) and ``names``
  the naming rules of models (``model_identity``, ``model_slug``).

May import: nothing of llmbatch outside the contract but :mod:`llmbatch.errors`, the
root of its exceptions, which imports nothing (tests/llmbatch/workflows/test_imports.py).
"""
