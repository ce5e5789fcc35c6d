"""Checking a job's inputs and splitting them into shards.

Shared by the ``plan_job`` activity and ``llm-batch submit``, so a bad job is refused
with the same message whether it comes from the CLI or from another service.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmbatch import formats, storage
from llmbatch.contract.spec import InputFormat, JobSpec, Task
from llmbatch.errors import LlmBatchError
from llmbatch.formats import openai_requests, openai_validation
from llmbatch.rendering.limits import RenderLimits
from llmbatch.rendering.pool import render_isolated
from llmbatch.rendering.templates import PromptTemplate, TemplateError

StoreFor = Callable[[str], storage.base.ObjectStore]


class InvalidJobSpec(LlmBatchError, ValueError):
    """The job can never run as given; the message says why."""


@dataclass(frozen=True)
class InputsInfo:
    objects: list[storage.base.ObjectInfo]
    input_format: InputFormat


def inspect_inputs(spec: JobSpec, store_for: StoreFor, limits: RenderLimits) -> InputsInfo:
    """Check the output can be written, list the inputs, settle their format and
    check the prompt against their fields and on their first readable row, rendered
    under ``limits`` as every row will be."""
    check_output(spec, store_for)
    objects: list[storage.base.ObjectInfo] = []
    for uri in spec.inputs:
        try:
            objects.extend(store_for(uri).list(uri))
        except storage.base.InputNotFound as exc:
            raise InvalidJobSpec(str(exc)) from exc
        except storage.base.StorageError as exc:
            raise InvalidJobSpec(f"cannot read input {uri}: {exc}") from exc
    if not objects:
        raise InvalidJobSpec(f"no input objects match {', '.join(spec.inputs)}")
    fmt = spec.input_format or _detect(objects, store_for)
    _check_has_rows(spec, objects, fmt, store_for)
    messages = spec.template_messages()
    if fmt is InputFormat.OPENAI and messages is not None:
        carried = "input" if spec.task is Task.EMBED else "messages"
        raise InvalidJobSpec(f"the input is OpenAI batch JSONL, which carries its own {carried}")
    if fmt is InputFormat.OPENAI:
        _check_request_sample(spec, objects[0], store_for)
    if fmt is not InputFormat.OPENAI:
        try:
            fields = formats.field_names(store_for(objects[0].uri), objects[0], fmt)
            row = formats.sample_row(
                store_for(objects[0].uri), objects[0], fmt, max_row_bytes=spec.max_row_bytes
            )
        except formats.FormatError as exc:
            raise InvalidJobSpec(str(exc)) from exc
        check_prompt(spec, fmt=fmt, fields=fields, row=row, where=objects[0].uri, limits=limits)
    return InputsInfo(objects=objects, input_format=fmt)


def validate_api_batch(
    spec: JobSpec, store_for: StoreFor, *, max_requests: int
) -> list[openai_validation.BatchError]:
    """Every line of an OpenAI Batch API batch's input checked, as OpenAI checks a
    batch file before running any of it; the errors found (none: the batch may run).

    Streams the file once with bounded memory (every invalid line is named, the first
    ones an entry each), and stops at the first request past ``max_requests``.
    """
    batch = spec.api_batch
    if batch is None:
        return []
    validator = openai_validation.BatchValidator(
        endpoint=batch.endpoint, model=spec.model, max_requests=max_requests
    )
    for uri in spec.inputs:
        try:
            objects = store_for(uri).list(uri)
        except storage.base.StorageError as exc:
            raise InvalidJobSpec(f"cannot read input {uri}: {exc}") from exc
        for obj in objects:
            lines = formats.iter_lines(store_for(obj.uri), obj.uri, max_bytes=spec.max_row_bytes)
            for line, data in lines:
                validator.add(line, data, max_bytes=spec.max_row_bytes)
                if validator.full:
                    return validator.finish()
    return validator.finish()


def check_output(spec: JobSpec, store_for: StoreFor) -> None:
    """Refuse an output that no write can reach, before a single one is tried: a
    missing bucket (an S3 server such as SeaweedFS would create it on the first write,
    and a typo would go unnoticed) or a folder outside the workers' local roots."""
    if spec.table_output:
        return  # a table: checked (and created) by llmbatch.tables
    try:
        store_for(spec.output_uri).check_output(spec.output_uri)
    except storage.base.StorageError as exc:
        raise InvalidJobSpec(f"cannot write output {spec.output_uri}: {exc}") from exc


def check_prompt(
    spec: JobSpec,
    *,
    fmt: InputFormat,
    fields: set[str] | list[str],
    row: dict[str, object] | None,
    where: str,
    limits: RenderLimits,
) -> None:
    """Refuse a prompt that uses fields the input (``where``) does not have, an id field
    it does not have, or a template that fails on its first row (an unsafe attribute,
    a loop past its time, a prompt past its size), which would fail on most rows."""
    messages = spec.template_messages()
    if messages is None:
        wanted = "the text template (text)" if spec.task is Task.EMBED else "prompt messages"
        raise InvalidJobSpec(f"the input is {fmt.value}: give the {wanted}")
    try:
        template = PromptTemplate(messages)
    except TemplateError as exc:
        raise InvalidJobSpec(str(exc)) from exc
    missing = template.missing_fields(set(fields))
    if fields and missing:
        raise InvalidJobSpec(
            f"the prompt uses field(s) {', '.join(missing)} that {where} does not "
            f"have; its fields are: {', '.join(sorted(fields))}"
        )
    if spec.id_field is not None and fields and spec.id_field not in fields:
        raise InvalidJobSpec(f"id field {spec.id_field!r} is not a field of {where}")
    if row is None or template.missing_fields(set(row)):
        return  # no row to try, or one the template cannot fill: that row is its own error
    outcome = render_isolated(messages, row, limits)
    if isinstance(outcome, TemplateError):
        raise InvalidJobSpec(f"the prompt fails on the first row of {where}: {outcome}")


def plan(spec: JobSpec, info: InputsInfo, store_for: StoreFor) -> list[formats.ShardPlan]:
    """Split every input object into shards of at most ``spec.shard_size`` rows."""
    try:
        shards = formats.plan_shards(
            store_for, info.objects, info.input_format, shard_size=spec.shard_size
        )
    except formats.FormatError as exc:
        raise InvalidJobSpec(str(exc)) from exc
    if not shards:
        # inspect_inputs saw rows in a head it could not settle (e.g. blank lines
        # past the first 256 KiB): a job of no items has nothing to do.
        raise InvalidJobSpec(_no_rows(spec))
    return shards


def _no_rows(spec: JobSpec) -> str:
    return f"input has no rows: {', '.join(spec.inputs)}"


def _check_has_rows(
    spec: JobSpec, objects: list[storage.base.ObjectInfo], fmt: InputFormat, store_for: StoreFor
) -> None:
    """Refuse a job without a single row (an empty file, a CSV header alone). Objects are
    read head first until one has a row, so a good job costs one read."""
    try:
        if any(formats.has_rows(store_for(o.uri), o, fmt) for o in objects):
            return
    except formats.FormatError as exc:
        raise InvalidJobSpec(str(exc)) from exc
    raise InvalidJobSpec(_no_rows(spec))


def _check_request_sample(spec: JobSpec, obj: storage.base.ObjectInfo, store_for: StoreFor) -> None:
    """Refuse OpenAI batch input whose first lines are all of the other task's kind (a
    file of embeddings submitted as a generate job, or the other way round). Any other
    fault of a line, an unsupported parameter too, stays that line's: it is
    dead-lettered (a 400 in an API batch's error file) and the rest runs."""
    wrong_task: list[str] = []
    sampled = 0
    for line, request in formats.sample_objects(store_for(obj.uri), obj):
        sampled += 1
        try:
            if spec.task is Task.EMBED:
                openai_requests.parse_embedding_request(
                    request, defaults=spec.embed_options, model=spec.model
                )
            else:
                openai_requests.parse(
                    request, defaults=spec.sampling, model=spec.model, endpoint=spec.endpoint
                )
        except openai_requests.WrongTask as exc:
            wrong_task.append(f"{obj.uri} line {line}: {exc}")
        except openai_requests.InvalidRequest:
            continue
    if wrong_task and len(wrong_task) == sampled:
        # Not one line of this job's kind: a file of the other kind, the task not given.
        raise InvalidJobSpec(wrong_task[0])


def _detect(objects: list[storage.base.ObjectInfo], store_for: StoreFor) -> InputFormat:
    detected = set()
    for obj in objects:
        head = store_for(obj.uri).read_range(obj.uri, 0, min(obj.size, 64 * 1024))
        try:
            detected.add(formats.detect_format(obj.uri, head))
        except formats.FormatError as exc:
            raise InvalidJobSpec(str(exc)) from exc
    if len(detected) > 1:
        kinds = ", ".join(sorted(f.value for f in detected))
        raise InvalidJobSpec(f"inputs mix formats ({kinds}); give one format per job")
    return detected.pop()
