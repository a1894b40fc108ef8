"""Handing a queued job to the host: ``POST job_dispatch_endpoint``, and what its answer means.

The runtime POSTs each job it cannot run itself (no local handler registered for its kind) to
the host's URL as JSON, with ``Authorization: Bearer <auth_token>`` and an ``Idempotency-Key``
(the job id: a retried POST names the same job). The body::

    {"job_id", "session_id", "name", "input", "attempt", "deadline_ms",
     "org_id", "user_id", "client_id"}

The host answers (``plan_answer``, pure):

- ``2xx`` with ``{"status": "completed", "result": ...}`` or ``{"status": "failed",
  "error": "..."}``: the host ran it already; that is its outcome.
- any other ``2xx`` (``202 Accepted``): the host took it; the job is ``started`` and the host
  reports back through the runtime that dispatched it: ``rt.tasks.report_progress``,
  ``rt.tasks.complete_job`` or ``rt.tasks.fail_job`` (its HTTP handler calls them).
- ``408``, ``425``, ``429``, ``5xx``, or no answer at all: tried again, with backoff, a bounded
  number of times; then the job fails (reason ``dispatch``).
- any other status: the host refused it; the job fails (reason ``dispatch``) with the status
  and the start of the body.

An answer body is read up to ``MAX_ANSWER_BYTES``; a longer one is treated as no answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from shared.errors import PleachError

from .jobs import MAX_JOB_BYTES, MAX_JOB_ERROR_CHARS, json_size

MAX_ANSWER_BYTES = 1024 * 1024
RETRY_STATUSES = frozenset({408, 425, 429})

Action = Literal["completed", "failed", "started", "retry", "refused"]


class DispatchError(PleachError):
    """The POST got no usable answer (connection refused, timeout, an answer too large)."""


@dataclass(frozen=True)
class Answer:
    """What the host's answer means for the job (see the module docstring)."""

    action: Action
    result: Any = None
    error: str = ""


class _Outcome(msgspec.Struct, kw_only=True):
    status: Literal["completed", "failed"]
    result: Any = None
    error: str = ""


def plan_answer(status: int, body: bytes) -> Answer:
    """Decide what an HTTP answer to a job POST means (module docstring)."""
    if 200 <= status < 300:
        try:
            outcome = msgspec.json.decode(body, type=_Outcome) if body.strip() else None
        except (msgspec.ValidationError, msgspec.DecodeError):
            outcome = None  # any other 2xx body: taken, results come later
        if outcome is None:
            return Answer("started")
        if outcome.status == "failed":
            error = outcome.error or "the host reported the job failed"
            return Answer("failed", error=error[:MAX_JOB_ERROR_CHARS])
        try:
            size = json_size(outcome.result)
        except TypeError:
            size = MAX_JOB_BYTES + 1
        if size > MAX_JOB_BYTES:
            return Answer("failed", error=f"the host's result is over {MAX_JOB_BYTES:,} bytes")
        return Answer("completed", result=outcome.result)
    if status in RETRY_STATUSES or status >= 500:
        return Answer("retry", error=f"HTTP {status}")
    text = body[:300].decode("utf-8", "replace").strip()
    return Answer("refused", error=f"the job endpoint refused the job: HTTP {status}: {text}")


async def post_json(
    client: Any, url: str, body: dict[str, Any], headers: dict[str, str], *, timeout: float
) -> tuple[int, bytes]:
    """POST ``body`` as JSON with ``client`` (an ``httpx2.AsyncClient``); the status and up
    to ``MAX_ANSWER_BYTES`` of the answer. ``DispatchError`` when there is no usable answer
    (the transport's errors are translated here)."""
    import httpx2

    try:
        async with client.stream(
            "POST",
            url,
            content=msgspec.json.encode(body),
            headers={"content-type": "application/json", **headers},
            timeout=timeout,
        ) as response:
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > MAX_ANSWER_BYTES:
                    raise DispatchError(f"the answer is over {MAX_ANSWER_BYTES:,} bytes")
            return int(response.status_code), bytes(data)
    except httpx2.HTTPError as exc:
        raise DispatchError(f"{type(exc).__name__}: {exc}") from exc


__all__ = ["MAX_ANSWER_BYTES", "Answer", "DispatchError", "plan_answer", "post_json"]
