"""Validating a whole OpenAI batch file before it runs (the OpenAI Batch API's
``validating``): every line checked one at a time, with memory bounded by the number of
requests; the faults as OpenAI's ``errors.data`` entries, with their line numbers.

Only faults of the file fail a batch; a line that is well formed but cannot run is
:mod:`llmbatch.formats.openai_requests`' (it dies on its own, a 400 in the error file).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from llmbatch.contract.names import model_identity
from llmbatch.contract.spec import ApiEndpoint
from llmbatch.formats.openai_requests import MODEL_NAME_CHARS

# Codes of a batch's ``errors.data`` entries, as OpenAI's Batch API names them.
INVALID_JSON_LINE = "invalid_json_line"
MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
INVALID_METHOD = "invalid_method"
URL_MISMATCH = "url_mismatch"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
MODEL_MISMATCH = "model_mismatch"
EMPTY_FILE = "empty_file"
TOO_MANY_TASKS = "too_many_tasks"
# Not OpenAI's (its limit is on the file): a line past the job's max_row_bytes.
LINE_TOO_LARGE = "line_too_large"
# Any other reason planning refuses the batch (an unsupported parameter on every line).
INVALID_REQUEST = "invalid_request"

# A failed batch lists this many invalid lines one entry each (the first ones, by line);
# every invalid line after them is still named, in one entry per code that lists their
# line numbers as ranges ("lines 101-250, 300"): one systematic fault would otherwise
# give a million entries.
MAX_BATCH_ERRORS = 100
# Ranges one such entry keeps (bounded memory); lines past them are counted.
MAX_LINE_RANGES = 1000


class BatchError(BaseModel):
    """One entry of a failed batch's ``errors.data``, as OpenAI's Batch API has it;
    ``line`` is 1-based. The one declaration: the validator writes these, the ledger
    keeps them as JSON, and the HTTP API answers them."""

    model_config = ConfigDict(frozen=True)

    code: str
    line: int | None = None
    message: str
    param: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass
class _LineRanges:
    """Line numbers (ascending) as ranges, at most MAX_LINE_RANGES of them."""

    first: str  # the message of the first line of these, which all lines share the code of
    param: str | None
    ranges: list[list[int]] = field(default_factory=list)
    lines: int = 0
    uncounted: int = 0

    def add(self, line: int) -> None:
        self.lines += 1
        if self.ranges and self.ranges[-1][1] == line - 1:
            self.ranges[-1][1] = line
        elif len(self.ranges) < MAX_LINE_RANGES:
            self.ranges.append([line, line])
        else:
            self.uncounted += 1

    def error(self, code: str) -> BatchError:
        shown = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in self.ranges)
        rest = f", and {self.uncounted} lines after those" if self.uncounted else ""
        noun = "line" if self.lines == 1 else "lines"
        return BatchError(
            code=code,
            line=self.ranges[0][0],
            message=f"{self.lines} more {noun} with this error, as the first says "
            f"({self.first}): {noun} {shown}{rest}.",
            param=self.param,
        )


@dataclass
class BatchValidator:
    """Checks every line of a batch file, one at a time (:meth:`add`), with memory
    bounded by the number of requests (a 16-byte digest per custom_id)."""

    endpoint: ApiEndpoint
    model: str
    max_requests: int
    max_errors: int = MAX_BATCH_ERRORS
    errors: list[BatchError] = field(default_factory=list)
    requests: int = 0
    _seen: dict[bytes, int] = field(default_factory=dict)
    # Invalid lines past the first max_errors, by code (named by finish()).
    _more: dict[str, _LineRanges] = field(default_factory=dict)

    @property
    def full(self) -> bool:
        """The file has too many requests: stop reading (the file is refused as such)."""
        return self.requests > self.max_requests

    def add(self, line: int, data: bytes | None, *, max_bytes: int) -> None:
        """Check the line numbered ``line``; ``data`` None means longer than ``max_bytes``."""
        self.requests += 1
        if self.requests > self.max_requests:
            self._error(
                TOO_MANY_TASKS,
                f"The batch input file has more than the maximum of {self.max_requests} requests.",
            )
            return
        if data is None:
            self._error(
                LINE_TOO_LARGE, f"This line is longer than the limit of {max_bytes} bytes.", line
            )
            return
        problem = self._check(data)
        if problem is not None:
            code, message, param = problem
            self._error(code, message, line, param)
            return

    def finish(self) -> list[BatchError]:
        """The errors found: the first ``max_errors`` invalid lines one entry each, then
        one entry per code naming the other lines; an empty file is an error too."""
        if self.requests == 0:
            self._error(EMPTY_FILE, "The batch input file is empty.")
        return self.errors + [more.error(code) for code, more in self._more.items()]

    def _error(
        self, code: str, message: str, line: int | None = None, param: str | None = None
    ) -> None:
        if len(self.errors) < self.max_errors or line is None:
            self.errors.append(BatchError(code=code, message=message, param=param, line=line))
            return
        # Past the entries kept one by one, the line is still named, by its code.
        self._more.setdefault(code, _LineRanges(first=message, param=param)).add(line)

    def _check(self, data: bytes) -> tuple[str, str, str | None] | None:
        try:
            request = json.loads(data)
        except ValueError:
            return INVALID_JSON_LINE, "This line is not parseable as valid JSON.", None
        if not isinstance(request, dict):
            return INVALID_JSON_LINE, "This line is not a JSON object.", None
        for name in ("custom_id", "method", "url", "body"):
            if request.get(name) is None:
                return MISSING_REQUIRED_PARAMETER, f"Missing required parameter: '{name}'.", name
        custom_id, body = request["custom_id"], request["body"]
        if not isinstance(custom_id, str) or not custom_id:
            return MISSING_REQUIRED_PARAMETER, "custom_id must be a non-empty string.", "custom_id"
        if not isinstance(body, dict):
            return MISSING_REQUIRED_PARAMETER, "body must be a JSON object.", "body"
        if str(request["method"]).upper() != "POST":
            return INVALID_METHOD, "The method of a batch request must be POST.", "method"
        if request["url"] != self.endpoint.value:
            return (
                URL_MISMATCH,
                f"The URL provided for this request does not match the batch endpoint "
                f"{self.endpoint.value}.",
                "url",
            )
        digest = hashlib.blake2b(custom_id.encode(), digest_size=16).digest()
        first = self._seen.setdefault(digest, self.requests)
        if first != self.requests:
            return (
                DUPLICATE_CUSTOM_ID,
                "The custom_id for this request is a duplicate of another request. The "
                "custom_id parameter must be unique for each request in a batch.",
                "custom_id",
            )
        named = body.get("model")
        if named is not None and (
            not isinstance(named, str) or model_identity(named) != model_identity(self.model)
        ):
            shown = str(named)[:MODEL_NAME_CHARS]
            return (
                MODEL_MISMATCH,
                f"The model {shown!r} of this request does not match the batch's model "
                f"{self.model!r}.",
                "body.model",
            )
        return None
