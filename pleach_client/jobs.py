"""Background jobs, as pure code: a job's lifecycle in its session's log, and who may write it.

A job lives in its session's hash-chained event log, like an interrupt: it is committed when
it is queued, survives a restart and syncs like every other event (no new record kind, no
server change). The device that queued it (its *owner*) runs it, locally or through the
host's job endpoint, and is the only one that writes its lifecycle:

- ``job.queued``: its event id is the job's id; it names the job kind (``name``), its
  ``input``, who runs it (``runner``: ``local`` or ``endpoint``), its deadline, and the turn
  and tool call that started it, if any.
- ``job.started`` (``attempt`` 1, or more after a restart resumed it), ``job.progress``
  (a fraction in [0, 1] and a message).
- ``job.completed`` (``result``), ``job.failed`` (``error`` and ``reason``: ``error``,
  ``timeout``, ``restart``, ``dispatch``) or ``job.cancelled``: final.
- ``job.cancel_requested``: any device asks the owner to cancel; the owner applies it (writes
  ``job.cancelled``) unless the job finished first.

The state of a job, on every device, from the log alone (``job_states``): the first
``job.queued`` of an id creates it; later events apply in log order when the state allows
them (``started`` and ``progress`` before the end, the first final event wins, a later one is
``overruled``). ``plan_*`` decide what a call writes; ``TasksFacet`` (``pleach_client.tasks``)
loads, calls them inside the write transaction and writes. Every payload from a peer is
validated here: a malformed event is refused alone (logged), and the rest of the log counts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from shared.errors import InvalidState
from shared.records import Event

from .payloads import read_payload

log = logging.getLogger("pleach.jobs")

JSON = Any
JobStatus = Literal["queued", "started", "completed", "failed", "cancelled"]
Runner = Literal["local", "endpoint"]
FailReason = Literal["error", "timeout", "restart", "dispatch"]

QUEUED = "job.queued"
STARTED = "job.started"
PROGRESS = "job.progress"
COMPLETED = "job.completed"
FAILED = "job.failed"
CANCELLED = "job.cancelled"
CANCEL_REQUESTED = "job.cancel_requested"
JOB_EVENTS = frozenset({QUEUED, STARTED, PROGRESS, COMPLETED, FAILED, CANCELLED, CANCEL_REQUESTED})
FINAL_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled"})

MAX_JOB_NAME_CHARS = 200
MAX_JOB_MESSAGE_CHARS = 2_000
"""The longest progress message or cancel reason a job event carries."""
MAX_JOB_ERROR_CHARS = 4_000
MAX_JOB_BYTES = 64 * 1024
"""The largest job input, and the largest result, as JSON (a larger result fails the job)."""
MAX_ATTEMPTS = 1_000

_JSON = msgspec.json.Encoder()


class _Queued(msgspec.Struct, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_JOB_NAME_CHARS)]
    input: dict[str, JSON] = {}
    runner: Runner = "local"
    deadline_ms: int | None = None
    turn_id: str | None = None
    tool_call_id: str | None = None


class _Started(msgspec.Struct, kw_only=True):
    job_id: str
    attempt: Annotated[int, msgspec.Meta(ge=1, le=MAX_ATTEMPTS)] = 1


class _Progress(msgspec.Struct, kw_only=True):
    job_id: str
    progress: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    message: Annotated[str, msgspec.Meta(max_length=MAX_JOB_MESSAGE_CHARS)] = ""


class _Completed(msgspec.Struct, kw_only=True):
    job_id: str
    result: JSON = None


class _Failed(msgspec.Struct, kw_only=True):
    job_id: str
    error: Annotated[str, msgspec.Meta(max_length=MAX_JOB_ERROR_CHARS)]
    reason: FailReason = "error"


class _Cancelled(msgspec.Struct, kw_only=True):
    job_id: str
    reason: Annotated[str, msgspec.Meta(max_length=MAX_JOB_MESSAGE_CHARS)] = ""
    requested_by: str | None = None


class _CancelRequested(msgspec.Struct, kw_only=True):
    job_id: str
    reason: Annotated[str, msgspec.Meta(max_length=MAX_JOB_MESSAGE_CHARS)] = ""


class Job(msgspec.Struct, kw_only=True):
    """One job as a session's log says it stands (see the module docstring).

    ``owner`` is the client id that queued it (the device that runs it); ``attempt`` counts
    its starts (a restart that resumes it starts it again). ``result`` is set when
    ``completed``; ``error`` and ``fail_reason`` when ``failed``; ``cancel_requested_by``
    when a device asked to cancel it. ``finished_by`` wrote its final event, ``event_id``.
    ``overruled`` are ids of events that came after the end and did not count.
    """

    id: str
    session_id: str
    name: str
    owner: str
    queued_at: str
    input: dict[str, JSON] = {}
    runner: Runner = "local"
    status: JobStatus = "queued"
    attempt: int = 0
    progress: float | None = None
    message: str = ""
    result: JSON = None
    error: str | None = None
    fail_reason: FailReason | None = None
    deadline_ms: int | None = None
    turn_id: str | None = None
    tool_call_id: str | None = None
    updated_at: str = ""
    cancel_requested_by: str | None = None
    cancel_reason: str = ""
    finished_by: str | None = None
    final_event_id: str | None = None
    overruled: list[str] = []

    @property
    def done(self) -> bool:
        """Final: completed, failed or cancelled."""
        return self.status in FINAL_STATUSES

    def overdue(self, now_ms: int) -> bool:
        """Still open past its deadline (its owner is away, or about to fail it)."""
        return not self.done and self.deadline_ms is not None and now_ms >= self.deadline_ms


def json_size(value: JSON) -> int:
    """How many bytes ``value`` takes as JSON (``TypeError`` when it is not JSON data)."""
    try:
        return len(_JSON.encode(value))
    except (TypeError, msgspec.EncodeError) as exc:
        raise TypeError(f"not JSON data: {exc}") from exc


def queued_payload(
    name: str,
    input: dict[str, JSON],
    *,
    runner: Runner,
    deadline_ms: int | None,
    turn_id: str | None = None,
    tool_call_id: str | None = None,
) -> dict[str, JSON]:
    """The payload of a ``job.queued`` event; ``ValueError`` says what is wrong with it."""
    if json_size(input) > MAX_JOB_BYTES:
        raise ValueError(f"the job input is over {MAX_JOB_BYTES:,} bytes as JSON")
    queued = _Queued(
        name=name,
        input=input,
        runner=runner,
        deadline_ms=deadline_ms,
        turn_id=turn_id,
        tool_call_id=tool_call_id,
    )
    try:
        checked = msgspec.convert(msgspec.to_builtins(queued), _Queued)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from exc
    payload: dict[str, JSON] = msgspec.to_builtins(checked)
    return payload


def job_states(events: Iterable[Event], start: dict[str, Job] | None = None) -> dict[str, Job]:
    """Fold a session's log, in chain order, into its jobs by id (module docstring).

    Events of other types are skipped; a malformed job event (a peer's junk) is logged and
    skipped alone, as is an event for a job that is not (yet) in the log. ``start``: what the
    log before ``events`` folded to (taken over and changed).
    """
    out: dict[str, Job] = {} if start is None else start
    for event in events:
        kind = event.type
        if kind not in JOB_EVENTS:
            continue
        if kind == QUEUED:
            if event.id in out:
                continue
            queued = read_payload(event, _Queued)
            if queued is None:
                continue
            if _too_big(event, queued.input, "input"):
                continue
            out[event.id] = Job(
                id=event.id,
                session_id=event.session_id,
                name=queued.name,
                owner=event.client_id,
                queued_at=event.hlc,
                input=queued.input,
                runner=queued.runner,
                deadline_ms=queued.deadline_ms,
                turn_id=queued.turn_id,
                tool_call_id=queued.tool_call_id,
                updated_at=event.hlc,
            )
            continue
        job_id = event.payload.get("job_id") if isinstance(event.payload, dict) else None
        job = out.get(job_id) if isinstance(job_id, str) else None
        if job is None:
            continue
        match kind:
            case "job.started":
                started = read_payload(event, _Started)
                if started is None:
                    continue
                if job.done:
                    job.overruled.append(event.id)
                    continue
                job.status = "started"
                job.attempt = max(job.attempt, started.attempt)
            case "job.progress":
                progress = read_payload(event, _Progress)
                if progress is None:
                    continue
                if job.done:
                    job.overruled.append(event.id)
                    continue
                if progress.progress is not None:
                    job.progress = progress.progress
                job.message = progress.message
            case "job.completed":
                completed = read_payload(event, _Completed)
                if completed is None or _too_big(event, completed.result, "result"):
                    continue
                if _finish(job, event):
                    job.status = "completed"
                    job.result = completed.result
                    job.progress = 1.0
            case "job.failed":
                failed = read_payload(event, _Failed)
                if failed is not None and _finish(job, event):
                    job.status = "failed"
                    job.error = failed.error
                    job.fail_reason = failed.reason
            case "job.cancelled":
                cancelled = read_payload(event, _Cancelled)
                if cancelled is not None and _finish(job, event):
                    job.status = "cancelled"
                    job.cancel_reason = cancelled.reason or job.cancel_reason
                    job.cancel_requested_by = cancelled.requested_by or job.cancel_requested_by
            case "job.cancel_requested":
                request = read_payload(event, _CancelRequested)
                if request is None:
                    continue
                if job.done or job.cancel_requested_by is not None:
                    job.overruled.append(event.id)
                    continue
                job.cancel_requested_by = event.client_id
                job.cancel_reason = request.reason
        job.updated_at = event.hlc
    return out


def job_event_fields(event: Event) -> dict[str, JSON] | None:
    """The fields of a lifecycle event for its stream event (``pleach_client.stream``):
    ``job_id``, ``status`` and what the event carries; None (logged) when it is not a valid
    job lifecycle event (a cancel request is not one: only its owner's answer is)."""
    match event.type:
        case "job.queued":
            queued = read_payload(event, _Queued)
            if queued is None:
                return None
            return {"job_id": event.id, "name": queued.name, "status": "queued"}
        case "job.started":
            started = read_payload(event, _Started)
            if started is None:
                return None
            return {"job_id": started.job_id, "status": "started", "attempt": started.attempt}
        case "job.progress":
            progress = read_payload(event, _Progress)
            if progress is None:
                return None
            return {
                "job_id": progress.job_id,
                "status": "started",
                "progress": progress.progress,
                "message": progress.message,
            }
        case "job.completed":
            completed = read_payload(event, _Completed)
            if completed is None or _too_big(event, completed.result, "result"):
                return None
            return {"job_id": completed.job_id, "status": "completed", "result": completed.result}
        case "job.failed":
            failed = read_payload(event, _Failed)
            if failed is None:
                return None
            return {
                "job_id": failed.job_id,
                "status": "failed",
                "error": failed.error,
                "reason": failed.reason,
            }
        case "job.cancelled":
            cancelled = read_payload(event, _Cancelled)
            if cancelled is None:
                return None
            return {"job_id": cancelled.job_id, "status": "cancelled", "reason": cancelled.reason}
    return None


def _finish(job: Job, event: Event) -> bool:
    if job.done:
        job.overruled.append(event.id)
        return False
    job.finished_by = event.client_id
    job.final_event_id = event.id
    return True


def _too_big(event: Event, value: JSON, what: str) -> bool:
    try:
        size = json_size(value)
    except TypeError:
        size = MAX_JOB_BYTES + 1
    if size <= MAX_JOB_BYTES:
        return False
    log.warning("%s event %s refused: its %s is over %d bytes", event.type, event.id, what, size)
    return True


# -- what a call writes --------------------------------------------------------------------------

Change = Literal["start", "progress", "complete", "fail", "cancel"]


@dataclass(frozen=True)
class UpdatePlan:
    """What a lifecycle call does to a job: the events to write (``(type, payload)``, maybe
    none), whether this call's word is the one in force (``accepted``), whether the job is
    final after it (``final``), and its status then."""

    writes: tuple[tuple[str, dict[str, JSON]], ...]
    accepted: bool
    final: bool
    status: JobStatus


def plan_update(
    job: Job,
    change: Change,
    *,
    owner: bool,
    by: str,
    attempt: int = 1,
    progress: float | None = None,
    message: str = "",
    result: JSON = None,
    error: str = "",
    reason: str = "",
    fail_reason: FailReason = "error",
) -> UpdatePlan:
    """Decide a lifecycle call on ``job`` as this device's log has it.

    ``owner``: this device queued the job (only it writes the lifecycle; another device's
    ``cancel`` is a request the owner applies). A call on a final job writes nothing and is
    not accepted; ``start`` of a job already started (a resumed attempt) is accepted. A
    ``complete`` or ``fail`` of a queued job (a host that answered before its dispatch was
    acknowledged) first writes ``started``, so every final job went through it.
    """
    payload: dict[str, JSON]
    if job.done:
        return UpdatePlan((), False, True, job.status)
    if change == "cancel" and not owner:
        if job.cancel_requested_by is not None:
            return UpdatePlan((), False, False, job.status)
        payload = {"job_id": job.id, "reason": _cut(reason, MAX_JOB_MESSAGE_CHARS)}
        return UpdatePlan(((CANCEL_REQUESTED, payload),), True, False, job.status)
    if not owner:
        raise InvalidState(
            f"job {job.id} runs on device {job.owner}: only that device writes its lifecycle"
        )
    started: tuple[tuple[str, dict[str, JSON]], ...] = ()
    if job.status == "queued" and change in ("progress", "complete", "fail"):
        started = ((STARTED, {"job_id": job.id, "attempt": max(1, job.attempt)}),)
    match change:
        case "start":
            payload = {"job_id": job.id, "attempt": max(1, min(attempt, MAX_ATTEMPTS))}
            return UpdatePlan(((STARTED, payload),), True, False, "started")
        case "progress":
            payload = {"job_id": job.id, "message": _cut(message, MAX_JOB_MESSAGE_CHARS)}
            if progress is not None:
                payload["progress"] = min(1.0, max(0.0, float(progress)))
            return UpdatePlan((*started, (PROGRESS, payload)), True, False, "started")
        case "complete":
            payload = {"job_id": job.id, "result": result}
            return UpdatePlan((*started, (COMPLETED, payload)), True, True, "completed")
        case "fail":
            payload = {
                "job_id": job.id,
                "error": _cut(error, MAX_JOB_ERROR_CHARS),
                "reason": fail_reason,
            }
            return UpdatePlan((*started, (FAILED, payload)), True, True, "failed")
        case "cancel":
            payload = {
                "job_id": job.id,
                "reason": _cut(reason or job.cancel_reason, MAX_JOB_MESSAGE_CHARS),
                "requested_by": job.cancel_requested_by or by,
            }
            return UpdatePlan(((CANCELLED, payload),), True, True, "cancelled")
    raise ValueError(f"unknown job change {change!r}")  # pragma: no cover


Recovery = Literal["resume", "redispatch", "await", "fail", "cancel", "drop"]


@dataclass(frozen=True)
class RecoverPlan:
    """What an owner does at open with a job it left open: ``resume`` it (start it again,
    attempt + 1), ``redispatch`` it (its POST never got an answer), ``await`` the host's
    result, ``fail`` it (``reason``, ``error``), ``cancel`` it (a device asked), or ``drop``
    it from its list (final)."""

    action: Recovery
    reason: FailReason | None = None
    error: str = ""


def plan_recover(job: Job, *, now_ms: int, handler: bool, resumable: bool) -> RecoverPlan:
    """Decide what happens, at open, to a job this device owns and left open (module
    docstring). A job is never left running: past its deadline it fails (``timeout``); a
    local job resumes only when its handler is registered and resumable, else it fails
    (``restart``); a job whose cancel was requested is cancelled."""
    if job.done:
        return RecoverPlan("drop")
    if job.cancel_requested_by is not None:
        return RecoverPlan("cancel")
    if job.deadline_ms is not None and now_ms >= job.deadline_ms:
        return RecoverPlan("fail", "timeout", "the job did not finish before its deadline")
    if job.runner == "endpoint":
        return RecoverPlan("redispatch" if job.status == "queued" else "await")
    if not handler:
        return RecoverPlan(
            "fail",
            "restart",
            f"the runtime stopped while the job ran, and no handler for {job.name!r} was "
            "registered when it opened again",
        )
    if resumable or job.status == "queued":
        return RecoverPlan("resume")
    return RecoverPlan("fail", "restart", "the runtime stopped while the job ran")


def next_job_deadline(jobs: Iterable[Job]) -> int | None:
    """The earliest deadline among the jobs that are still open (wall-clock ms)."""
    deadlines = [j.deadline_ms for j in jobs if not j.done and j.deadline_ms is not None]
    return min(deadlines) if deadlines else None


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


__all__ = [
    "CANCELLED",
    "CANCEL_REQUESTED",
    "COMPLETED",
    "FAILED",
    "JOB_EVENTS",
    "MAX_JOB_BYTES",
    "PROGRESS",
    "QUEUED",
    "STARTED",
    "FailReason",
    "Job",
    "JobStatus",
    "RecoverPlan",
    "Runner",
    "UpdatePlan",
    "job_event_fields",
    "job_states",
    "json_size",
    "next_job_deadline",
    "plan_recover",
    "plan_update",
    "queued_payload",
]
