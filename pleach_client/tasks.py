"""``runtime.tasks``: subagents and background jobs (the reference's ``runtime.async``, a
keyword in Python). ``rt.get_async_task_manager()`` returns it.

Subagents (``pleach_client.subagents``): ``rt.tasks.spawn(...)`` from the host or from a tool,
or the model's ``subagent`` tool (``SUBAGENT_TOOL``); ``rt.tasks.subagents`` bounds how many
run at once.

Jobs (rules: ``pleach_client.jobs``): ``start_job`` queues a job in its session's log and runs
it on this device, with a handler registered for its kind (``register_job`` or
``SessionRuntime(job_handlers=...)``) or, with none, by POSTing it to the host's
``job_dispatch_endpoint`` (``pleach_client.dispatch``). Only this device writes the job's
lifecycle; every device of the user sees it (its stream events in the ``updates`` mode,
``get_job``, ``list_jobs``) and may ask to cancel it (``cancel_job``), which the owner applies
when the request reaches it. A job outlives the turn that started it; a job still open when
the runtime closes (or dies) is resumed or marked failed when it opens again, and a job past
its deadline fails: none stays open forever. ``wait_for_jobs`` (and the ``wait_for_jobs``
tool) waits for a session's jobs, woken by writes and sync pages, never by polling.

The jobs this device owns and has not finished are listed in its store (``sync_state`` key
``jobs_open``, written in the same transaction as their events, with the process and
runtime running each), so a restart finds them without reading every log, and a second
process on the same file leaves the jobs of a live first one alone. Limits are attributes
with defaults: ``job_timeout`` (3600 s),
``max_running_jobs`` (8 handlers at once; more stay queued), ``max_open_jobs`` (256),
``progress_interval`` (1 s between written progress events of a job), ``dispatch_attempts``
(5), ``dispatch_backoff`` (0.2 s, doubling), ``dispatch_timeout`` (10 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from shared.errors import InvalidInput, InvalidState, NotFound, ToolError
from shared.ids import uuid7
from shared.records import AuditRow, Event

from .core import SessionChange, existing
from .dispatch import DispatchError, plan_answer, post_json
from .jobs import (
    MAX_JOB_BYTES,
    QUEUED,
    FailReason,
    Job,
    job_states,
    json_size,
    plan_recover,
    plan_update,
    queued_payload,
)
from .jobs import Change as JobChange
from .lineage import current_tool_call
from .receipts import JobReceipt, JobsWaitReceipt, JobUpdateReceipt, SubagentResult
from .store.base import TxReader
from .stream import StreamEventBase, job_events
from .subagents import SUBAGENT_TOOL_NAME, SubagentManager
from .tools import Tool

if TYPE_CHECKING:
    from .runtime import SessionRuntime

log = logging.getLogger("pleach.tasks")

JSON = Any
INDEX_KEY = "jobs_open"
WAIT_FOR_JOBS_TOOL_NAME = "wait_for_jobs"
DEFAULT_JOB_TIMEOUT = 3600.0
MAX_WAIT_SECONDS = 3600.0
DEFAULT_TOOL_WAIT_SECONDS = 300.0


class _Entry(msgspec.Struct, kw_only=True):
    """A job this device runs and has not finished, in its store's ``jobs_open`` list: its
    session and its runner (``"{pid}:{runtime instance}"``), so a second process on the
    same file leaves the jobs of a live one alone."""

    session_id: str
    runner: str = ""


_INDEX = msgspec.json.Decoder(dict[str, _Entry])
_LIVE: set[str] = set()
"""The runners of the ``TasksFacet`` instances open in this process."""


@dataclass(frozen=True)
class JobHandler:
    """Runs jobs of kind ``name`` on this device: ``fn(ctx)`` (sync or async) returns the
    job's result (JSON data, at most 64 KiB as JSON); raising fails the job with the error.
    ``resumable``: a job that was running when the runtime stopped is started again (attempt
    + 1) at the next open; otherwise it is marked failed then."""

    name: str
    fn: Callable[[JobContext], JSON | Awaitable[JSON]]
    resumable: bool = False


class JobContext:
    """What a job handler gets: the job's id, session, kind, input and attempt, and
    ``progress()`` to report how far it is (written at most every ``progress_interval``)."""

    def __init__(
        self, tasks: TasksFacet, job_id: str, session_id: str, name: str, input: JSON, attempt: int
    ) -> None:
        self._tasks = tasks
        self.job_id = job_id
        self.session_id = session_id
        self.name = name
        self.input = input
        self.attempt = attempt

    async def progress(self, progress: float | None = None, message: str = "") -> bool:
        """Report progress (a fraction in [0, 1], a message); True when it was written."""
        receipt = await self._tasks.report_progress(self.job_id, progress, message)
        return receipt.accepted


class TasksFacet:
    """Subagents and background jobs (module docstring)."""

    def __init__(
        self,
        rt: SessionRuntime,
        *,
        enable_subagent_concurrency: bool = False,
        max_concurrent_subagents: int = 4,
        max_subagent_depth: int = 1,
        job_dispatch_endpoint: str | None = None,
        auth_token: str | None = None,
        job_handlers: Iterable[JobHandler] = (),
    ) -> None:
        if job_dispatch_endpoint is not None and not job_dispatch_endpoint.startswith(
            ("http://", "https://")
        ):
            raise InvalidInput(
                f"job_dispatch_endpoint must be an http:// or https:// URL, not "
                f"{job_dispatch_endpoint!r}"
            )
        self._rt = rt
        self.subagents = SubagentManager(
            rt,
            concurrency=enable_subagent_concurrency,
            max_concurrent=max_concurrent_subagents,
            max_depth=max_subagent_depth,
        )
        self.job_dispatch_endpoint = job_dispatch_endpoint
        self.auth_token = auth_token
        self.job_timeout = DEFAULT_JOB_TIMEOUT
        self.max_running_jobs = 8
        self.max_open_jobs = 256
        self.progress_interval = 1.0
        self.dispatch_attempts = 5
        self.dispatch_backoff = 0.2
        self.dispatch_timeout = 10.0
        self._handlers: dict[str, JobHandler] = {}
        for handler in job_handlers:
            self._register(handler)
        self._open: dict[str, str] = {}
        self._deadlines: dict[str, int] = {}
        self._runs: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._writes: set[asyncio.Task[Any]] = set()
        self._outcomes: dict[str, JobUpdateReceipt] = {}  # the latest write of each run
        self._lock = asyncio.Lock()
        self._run_slots: asyncio.Semaphore | None = None
        self._wakes: dict[str, set[asyncio.Event]] = {}
        self._last_progress: dict[str, float] = {}
        self._closing = asyncio.Event()
        self._deadline_wake = asyncio.Event()
        self._http: Any | None = None
        self._opened = False
        self._runner = ""
        rt.bus.on("sync.applied", self._on_applied)

    # -- subagents --------------------------------------------------------------------------
    async def spawn(
        self,
        prompt: str,
        *,
        session_id: str | None = None,
        tools: Sequence[str] | None = None,
        system: str | None = None,
        max_tool_iterations: int | None = None,
        max_tokens: int | None = None,
        title: str = "",
        abort: asyncio.Event | None = None,
    ) -> SubagentResult:
        """Run a subagent (``SubagentManager.spawn``): from a tool, a child of its turn;
        from the host, of ``session_id``."""
        return await self.subagents.spawn(
            prompt,
            session_id=session_id,
            tools=tools,
            system=system,
            max_tool_iterations=max_tool_iterations,
            max_tokens=max_tokens,
            title=title,
            abort=abort,
        )

    async def end_turn(self, turn_id: str) -> int:
        """A turn ends (committing, whatever its outcome): abort what of its subagents still
        runs and wait for their accounting. The turn calls this before it commits."""
        return await self.subagents.abort_turn(turn_id)

    async def subagent_audit_rows(self, session_id: str) -> list[AuditRow]:
        """The audit rows of a session's subagents (for its rollup)."""
        return await self.subagents.audit_rows(session_id)

    # -- jobs: the owner's side ---------------------------------------------------------------
    def register_job(
        self,
        name: str,
        fn: Callable[[JobContext], JSON | Awaitable[JSON]],
        *,
        resumable: bool = False,
    ) -> JobHandler:
        """Run jobs of kind ``name`` here with ``fn`` (``JobHandler``). Register before the
        runtime opens for its jobs left open by a restart to resume."""
        return self._register(JobHandler(name=name, fn=fn, resumable=resumable))

    def _register(self, handler: JobHandler) -> JobHandler:
        if handler.name in self._handlers:
            raise InvalidInput(f"a handler for job kind {handler.name!r} is already registered")
        self._handlers[handler.name] = handler
        return handler

    async def start_job(
        self,
        session_id: str,
        name: str,
        input: dict[str, JSON] | None = None,
        *,
        timeout: float | None = None,
    ) -> JobReceipt:
        """Queue a job of kind ``name`` in ``session_id`` and run it on this device: with its
        registered handler, else through ``job_dispatch_endpoint``. Returns once ``queued``
        is committed. ``timeout`` (seconds, default ``job_timeout``): it fails after that.
        Called from a tool, the job names the turn and call that started it.
        ``InvalidInput`` for a kind nobody runs or an input too large; ``InvalidState``
        past ``max_open_jobs`` or while closing; ``NotFound`` for a missing session."""
        self._require_open()
        body = dict(input or {})
        runner = "local" if name in self._handlers else "endpoint"
        if runner == "endpoint" and self.job_dispatch_endpoint is None:
            raise InvalidInput(
                f"no handler for job kind {name!r} (rt.tasks.register_job) and no "
                "job_dispatch_endpoint to send it to"
            )
        seconds = self.job_timeout if timeout is None else timeout
        if not seconds > 0:
            raise InvalidInput(f"a job's timeout must be > 0 seconds, not {timeout!r}")
        ctx = current_tool_call()
        here = ctx is not None and ctx.session_id == session_id
        deadline = self._rt.wall_ms() + round(seconds * 1000)
        try:
            payload = queued_payload(
                name,
                body,
                runner=runner,  # type: ignore[arg-type]
                deadline_ms=deadline,
                turn_id=ctx.turn_id if here and ctx is not None else None,
                tool_call_id=ctx.tool_call_id if here and ctx is not None else None,
            )
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"job {name!r} cannot be queued: {exc}") from exc
        core = self._rt.core
        draft = core.draft_event(session_id, QUEUED, payload)
        async with self._lock:
            if len(self._open) >= self.max_open_jobs:
                raise InvalidState(
                    f"this device already has {len(self._open)} open jobs (max_open_jobs)"
                )
            result = await core.write(
                [(session_id, existing(lambda _: SessionChange(events=[draft])))],
                meta=self._index_meta(add={draft.id: session_id}),
            )
            self._open[draft.id] = session_id
        self._deadlines[draft.id] = deadline
        self._deadline_wake.set()
        self._announce(result.events, {draft.id: name})
        placed = next(e for e in result.events if e.id == draft.id)
        job = job_states([placed])[placed.id]
        self._launch(job)
        return JobReceipt(
            job_id=job.id,
            session_id=session_id,
            name=name,
            runner=job.runner,
            status="queued",
            deadline_ms=deadline,
            event_id=placed.id,
        )

    async def report_progress(
        self, job_id: str, progress: float | None = None, message: str = ""
    ) -> JobUpdateReceipt:
        """Report a running job's progress (on the device that runs it). A report within
        ``progress_interval`` of the last one written for the job is not written
        (``accepted=False``); the final event carries the final state anyway."""
        if progress is not None and not (0.0 <= float(progress) <= 1.0):
            raise InvalidInput(f"progress is a fraction in [0, 1], not {progress!r}")
        now = time.monotonic()
        last = self._last_progress.get(job_id)
        if last is not None and now - last < self.progress_interval:
            job = await self.get_job(job_id)
            return JobUpdateReceipt(
                job_id=job_id,
                session_id=job.session_id,
                accepted=False,
                final=job.done,
                status=job.status,
                job=job,
            )
        receipt = await self._update(job_id, "progress", progress=progress, message=message)
        if receipt.accepted:
            self._last_progress[job_id] = now
        return receipt

    async def complete_job(self, job_id: str, result: JSON = None) -> JobUpdateReceipt:
        """The job's result (JSON data, at most 64 KiB as JSON), on the device that runs it:
        the host's HTTP handler calls this for a dispatched job. Not accepted when the job
        was over already (cancelled, timed out). ``InvalidState`` on another device."""
        try:
            size = json_size(result)
        except TypeError as exc:
            raise InvalidInput(f"a job's result must be JSON data: {exc}") from exc
        if size > MAX_JOB_BYTES:
            raise InvalidInput(f"the job's result is {size:,} bytes, over {MAX_JOB_BYTES:,}")
        return await self._update(job_id, "complete", result=result)

    async def fail_job(self, job_id: str, error: str) -> JobUpdateReceipt:
        """The job failed with ``error``, on the device that runs it (as ``complete_job``)."""
        return await self._update(job_id, "fail", error=str(error) or "failed")

    async def cancel_job(self, job_id: str, reason: str = "") -> JobUpdateReceipt:
        """Cancel a job. On the device that runs it: its handler is cancelled and the job
        is ``cancelled`` (final), unless it finished first (``accepted=False``). Elsewhere:
        a request (``accepted``, not ``final``) that the owner applies when it arrives."""
        job = await self.get_job(job_id)
        if await self._owns(job):
            await self._stop_run(job_id)
        return await self._update(job_id, "cancel", reason=reason)

    # -- jobs: reads -------------------------------------------------------------------------
    async def get_job(self, job_id: str) -> Job:
        """One job as this device's log has it; ``NotFound`` when it has not seen it."""
        queued = await self._queued(job_id)
        events = await self._rt.store.list_events(
            queued.session_id, from_sequence=queued.sequence_number
        )
        found = job_states(events).get(job_id)
        if found is None:
            raise NotFound(f"job {job_id} has a malformed request; it was refused")
        return found

    async def list_jobs(
        self, session_id: str | None = None, *, include_finished: bool = False
    ) -> list[Job]:
        """The jobs of one session (or of every session: that reads every log), in log
        order; open ones only unless ``include_finished``."""
        store = self._rt.store
        if session_id is not None:
            sessions = [session_id]
        else:
            sessions = [s.id for s in await store.list_sessions()]
        out: list[Job] = []
        for sid in sessions:
            jobs = job_states(await store.list_events(sid)).values()
            out.extend(j for j in jobs if include_finished or not j.done)
        return out

    async def wait_for_jobs(
        self,
        session_id: str,
        job_ids: Iterable[str] | None = None,
        *,
        timeout: float | None = None,
        abort: asyncio.Event | None = None,
    ) -> JobsWaitReceipt:
        """Wait until the named jobs of ``session_id`` (by default every job of it open now)
        are over, ``timeout`` seconds pass, ``abort`` is set or the runtime closes. Woken by
        this device's job writes and by sync pages of the session (a job another device
        runs). ``NotFound`` for a job id not in the session."""
        wanted = list(dict.fromkeys(job_ids)) if job_ids is not None else None
        loop = asyncio.get_running_loop()
        until = None if timeout is None else loop.time() + max(0.0, timeout)
        wake = asyncio.Event()
        self._wakes.setdefault(session_id, set()).add(wake)
        try:
            while True:
                wake.clear()
                jobs = job_states(await self._rt.store.list_events(session_id))
                if wanted is None:
                    wanted = [j.id for j in jobs.values() if not j.done]
                missing = [i for i in wanted if i not in jobs]
                if missing:
                    raise NotFound(f"no job(s) {missing} in session {session_id} on this device")
                chosen = [jobs[i] for i in wanted]
                done = all(j.done for j in chosen)
                remaining = None if until is None else until - loop.time()
                stop = (
                    done
                    or (remaining is not None and remaining <= 0)
                    or (abort is not None and abort.is_set())
                    or self._closing.is_set()
                )
                if stop:
                    return JobsWaitReceipt(
                        session_id=session_id,
                        jobs=chosen,
                        done=done,
                        timed_out=not done and remaining is not None and remaining <= 0,
                        aborted=not done and abort is not None and abort.is_set(),
                    )
                waits = [wake.wait(), self._closing.wait()]
                if abort is not None:
                    waits.append(abort.wait())
                await _first(waits, timeout=remaining)
        finally:
            self._unwake(session_id, wake)

    async def wait_for_jobs_result(self, session_id: str, tool_input: dict[str, JSON]) -> str:
        """What the ``wait_for_jobs`` tool answers the model: the jobs waited on (``job_ids``,
        default every open job of the session) as JSON, once over or after
        ``timeout_seconds`` (default 300, at most 3600)."""
        ids = tool_input.get("job_ids")
        if ids is not None and (
            not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)
        ):
            raise ToolError("wait_for_jobs: 'job_ids' must be a list of job ids")
        seconds = tool_input.get("timeout_seconds", DEFAULT_TOOL_WAIT_SECONDS)
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds < 0:
            raise ToolError("wait_for_jobs: 'timeout_seconds' must be a number >= 0")
        try:
            receipt = await self.wait_for_jobs(
                session_id, ids, timeout=min(float(seconds), MAX_WAIT_SECONDS)
            )
        except NotFound as exc:
            raise ToolError(str(exc)) from exc
        return msgspec.json.encode(
            {
                "done": receipt.done,
                "timed_out": receipt.timed_out,
                "jobs": [_job_summary(j) for j in receipt.jobs],
            }
        ).decode()

    # -- lifecycle ---------------------------------------------------------------------------
    async def open(self) -> None:
        """Recover the jobs this device left open (resume, re-dispatch, await, or fail them:
        ``jobs.plan_recover``) and start watching deadlines."""
        self._closing.clear()
        self.subagents.open()
        self._opened = True
        self._runner = f"{os.getpid()}:{uuid7()}"
        _LIVE.add(self._runner)
        # Adopt the open jobs whose runner is gone (a closed runtime, a dead process); a
        # live one (another process on this file) keeps its own.
        async with self._lock:
            entries = await self._entries()
            adopted = {j: e.session_id for j, e in entries.items() if not _alive(e.runner)}
            if adopted:
                await self._rt.core.write(meta=self._index_meta(add=adopted))
            self._open = adopted
        for job_id in list(self._open):
            try:
                job = await self.get_job(job_id)
            except NotFound:
                await self._forget(job_id)
                continue
            await self._recover(job)
        self._spawn(self._watch_deadlines())

    async def close(self) -> None:
        """Abort running subagents (accounted), stop job handlers and dispatches (their jobs
        stay open: the next open resumes or fails them), and release every waiter."""
        if not self._opened:
            return
        self._opened = False
        self._closing.set()
        _LIVE.discard(self._runner)
        await self.subagents.close()
        tasks = [*self._runs.values(), *self._background]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if self._writes:  # every job write in flight lands before the store closes
            await asyncio.wait(set(self._writes))
        self._runs.clear()
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()

    # -- internals: writing ------------------------------------------------------------------
    async def _update(
        self,
        job_id: str,
        change: JobChange,
        *,
        attempt: int = 1,
        progress: float | None = None,
        message: str = "",
        result: JSON = None,
        error: str = "",
        reason: str = "",
        fail_reason: FailReason = "error",
    ) -> JobUpdateReceipt:
        """Write a lifecycle change, decided under the store's write lock on the job as
        the log has it then (``plan_update``)."""
        queued = await self._queued(job_id)
        session_id = queued.session_id
        core = self._rt.core
        mine = {core.client_id, *await core.previous_client_ids()}
        plans: list[Any] = []

        async def prepare(tx: TxReader) -> tuple[list[Any], list[AuditRow]]:
            events = await tx.list_events(session_id, from_sequence=queued.sequence_number)
            job = job_states(events).get(job_id)
            if job is None:
                raise NotFound(f"job {job_id} has a malformed request; it was refused")
            plan = plan_update(
                job,
                change,
                owner=job.owner in mine,
                by=core.client_id,
                attempt=attempt,
                progress=progress,
                message=message,
                result=result,
                error=error,
                reason=reason,
                fail_reason=fail_reason,
            )
            drafts = [core.draft_event(session_id, kind, payload) for kind, payload in plan.writes]
            plans[:] = [job, plan]
            if not drafts:
                return [], []
            return [(session_id, lambda _: SessionChange(events=drafts))], []

        closes = change in ("complete", "fail", "cancel") and job_id in self._open
        async with self._lock:
            meta = self._index_meta(remove=[job_id]) if closes else None
            written = await core.write(prepare=prepare, meta=meta)
            if closes:
                self._open.pop(job_id, None)
        job, plan = plans
        if plan.final:
            self._deadlines.pop(job_id, None)
            self._last_progress.pop(job_id, None)
        self._announce(written.events, {job_id: job.name})
        after = await self.get_job(job_id) if written.events else job
        return JobUpdateReceipt(
            job_id=job_id,
            session_id=session_id,
            accepted=plan.accepted,
            final=after.done,
            status=after.status,
            event_ids=[e.id for e in written.events],
            job=after,
        )

    async def _forget(self, job_id: str) -> None:
        async with self._lock:
            await self._rt.core.write(meta=self._index_meta(remove=[job_id]))
            self._open.pop(job_id, None)
        self._deadlines.pop(job_id, None)

    async def _entries(self, tx: TxReader | None = None) -> dict[str, _Entry]:
        raw = await (tx or self._rt.store).get_meta(INDEX_KEY)
        try:
            return _INDEX.decode(raw) if raw else {}
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("the stored list of open jobs is unreadable; it is started again")
            return {}

    def _index_meta(
        self, *, add: dict[str, str] | None = None, remove: Iterable[str] = ()
    ) -> Callable[[TxReader], Awaitable[dict[str, str]]]:
        """The ``jobs_open`` update of a write, computed inside its transaction (under the
        store's write lock), so entries another process on the file wrote meanwhile stay."""
        drop = list(remove)

        async def compute(tx: TxReader) -> dict[str, str]:
            return {INDEX_KEY: await self._index(tx, add=add, remove=drop)}

        return compute

    async def _index(
        self,
        tx: TxReader | None = None,
        *,
        add: dict[str, str] | None = None,
        remove: Iterable[str] = (),
    ) -> str:
        """The ``jobs_open`` list as ``tx`` (or the store) holds it, with ``add`` (job ->
        session, run here) and without ``remove``."""
        entries = await self._entries(tx)
        for job_id, session_id in (add or {}).items():
            entries[job_id] = _Entry(session_id=session_id, runner=self._runner)
        for job_id in remove:
            entries.pop(job_id, None)
        return msgspec.json.encode(entries).decode()

    def _announce(self, events: list[Event], names: dict[str, str]) -> None:
        """Raise the stream events of what was just written, and wake the waiters."""
        for event in job_events(events, names):
            self._rt.emit(event)
        for session_id in {e.session_id for e in events}:
            self._wake(session_id)

    # -- internals: running ------------------------------------------------------------------
    def _launch(self, job: Job, *, attempt: int = 1) -> None:
        if job.runner == "local":
            handler = self._handlers.get(job.name)
            if handler is not None:
                run = self._run_local(job, handler, attempt)
                self._runs[job.id] = self._spawn(self._in_span(job, "local", attempt, run))
        else:
            run = self._dispatch(job)
            self._runs[job.id] = self._spawn(self._in_span(job, "dispatch", attempt, run))

    async def _in_span(self, job: Job, runner: str, attempt: int, run: Awaitable[None]) -> None:
        """A ``pleach.job`` span around one run of a job (here, or posted to the host)."""
        span = self._rt.spans.start(
            "pleach.job",
            kind="job",
            attributes={
                "pleach.job_id": job.id,
                "pleach.job": job.name,
                "pleach.session_id": job.session_id,
                "pleach.runner": runner,
                "pleach.attempt": attempt,
            },
        )
        self._outcomes.pop(job.id, None)
        try:
            await run
        except asyncio.CancelledError:
            span.set(**{"pleach.cancelled": True})
            # A write the run began before the cancel still lands (shielded): its outcome
            # is the run's, so wait for it before the span ends.
            pending = [t for t in self._writes if not t.done()]
            if pending:
                await asyncio.wait(pending)
            raise
        except BaseException as exc:
            span.error(exc)
            raise
        finally:
            # What the run last wrote is its outcome, even when a close cancelled it after.
            last = self._outcomes.pop(job.id, None)
            if last is not None:
                span.set(**{"pleach.status": last.status})
                if last.status == "failed":
                    error = last.job.error if last.job is not None else None
                    span.error(error or "failed")
            span.end()

    async def _run_local(self, job: Job, handler: JobHandler, attempt: int) -> None:
        if self._run_slots is None:
            self._run_slots = asyncio.Semaphore(max(1, self.max_running_jobs))
        try:
            async with self._run_slots:
                started = await self._shielded(self._update(job.id, "start", attempt=attempt))
                if not started.accepted:
                    return  # over meanwhile (cancelled, timed out)
                ctx = JobContext(self, job.id, job.session_id, job.name, job.input, attempt)
                try:
                    value = handler.fn(ctx)
                    if inspect.isawaitable(value):
                        value = await value
                    json_size(value)
                except asyncio.CancelledError:
                    raise
                except TypeError as exc:
                    await self._shielded(self._fail(job.id, f"the job's result: {exc}"))
                    return
                except Exception as exc:  # a handler's failure is the job's outcome
                    await self._shielded(self._fail(job.id, f"{type(exc).__name__}: {exc}"))
                    return
                if json_size(value) > MAX_JOB_BYTES:
                    await self._shielded(
                        self._fail(job.id, f"the job's result is over {MAX_JOB_BYTES:,} bytes")
                    )
                    return
                await self._shielded(self._update(job.id, "complete", result=value))
        finally:
            if self._runs.get(job.id) is asyncio.current_task():
                del self._runs[job.id]

    async def _fail(
        self, job_id: str, error: str, reason: FailReason = "error"
    ) -> JobUpdateReceipt:
        return await self._update(job_id, "fail", error=error, fail_reason=reason)

    async def _shielded(self, write: Awaitable[JobUpdateReceipt]) -> JobUpdateReceipt:
        """A handler's write, finished even when its task is cancelled meanwhile (``close``
        waits for it before the store closes)."""
        task = asyncio.ensure_future(self._noted(write))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return await asyncio.shield(task)

    async def _noted(self, write: Awaitable[JobUpdateReceipt]) -> JobUpdateReceipt:
        """``write``, its receipt kept as the run's latest write for its span before the task
        is done: a done-callback ran a loop turn later, and a close that cancelled the run in
        between ended its span without the outcome (a failed job's span said "started")."""
        receipt = await write
        self._outcomes[receipt.job_id] = receipt
        return receipt

    async def _dispatch(self, job: Job) -> None:
        """POST the job to the host, retrying what may pass (``dispatch.plan_answer``)."""
        url = self.job_dispatch_endpoint
        try:
            if url is None:
                await self._shielded(
                    self._fail(job.id, "no job_dispatch_endpoint to send the job to", "dispatch")
                )
                return
            core = self._rt.core
            body = {
                "job_id": job.id,
                "session_id": job.session_id,
                "name": job.name,
                "input": job.input,
                "attempt": max(1, job.attempt),
                "deadline_ms": job.deadline_ms,
                "org_id": core.org_id,
                "user_id": core.user_id,
                "client_id": core.client_id,
            }
            headers = {"idempotency-key": job.id}
            if self.auth_token:
                headers["authorization"] = f"Bearer {self.auth_token}"
            delay, last = self.dispatch_backoff, ""
            for attempt in range(1, max(1, self.dispatch_attempts) + 1):
                try:
                    status, data = await post_json(
                        self._client(), url, body, headers, timeout=self.dispatch_timeout
                    )
                except DispatchError as exc:
                    last = str(exc)
                else:
                    answer = plan_answer(status, data)
                    match answer.action:
                        case "completed":
                            await self._shielded(
                                self._update(job.id, "complete", result=answer.result)
                            )
                            return
                        case "failed":
                            await self._shielded(self._fail(job.id, answer.error))
                            return
                        case "refused":
                            await self._shielded(self._fail(job.id, answer.error, "dispatch"))
                            return
                        case "started":
                            await self._shielded(
                                self._update(job.id, "start", attempt=max(1, job.attempt))
                            )
                            return
                    last = answer.error
                if attempt < self.dispatch_attempts:
                    await _first([self._closing.wait()], timeout=delay)
                    if self._closing.is_set():
                        return  # the next open dispatches it again
                    delay = min(delay * 2, 5.0)
            await self._shielded(
                self._fail(
                    job.id,
                    f"the job endpoint could not take the job after {self.dispatch_attempts} "
                    f"attempt(s): {last}",
                    "dispatch",
                )
            )
        finally:
            if self._runs.get(job.id) is asyncio.current_task():
                del self._runs[job.id]

    def _client(self) -> Any:
        if self._http is None:
            import httpx2

            self._http = httpx2.AsyncClient()
        return self._http

    async def _stop_run(self, job_id: str) -> None:
        task = self._runs.pop(job_id, None)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})

    async def _recover(self, job: Job) -> None:
        handler = self._handlers.get(job.name)
        plan = plan_recover(
            job,
            now_ms=self._rt.wall_ms(),
            handler=handler is not None,
            resumable=handler is not None and handler.resumable,
        )
        log.info("job %s (%s, %s) at open: %s", job.id, job.name, job.status, plan.action)
        if job.deadline_ms is not None and not job.done:
            self._deadlines[job.id] = job.deadline_ms
        match plan.action:
            case "drop":
                await self._forget(job.id)
            case "fail":
                await self._fail(job.id, plan.error, plan.reason or "restart")
            case "cancel":
                await self._update(job.id, "cancel")
            case "resume":
                self._launch(job, attempt=job.attempt + 1)
            case "redispatch":
                self._launch(job)
            case "await":
                pass  # the host still holds it and reports to this runtime

    async def _watch_deadlines(self) -> None:
        """Fail the jobs this device runs that pass their deadline (reason ``timeout``)."""
        while not self._closing.is_set():
            self._deadline_wake.clear()
            now = self._rt.wall_ms()
            due = [j for j, d in self._deadlines.items() if d <= now and j in self._open]
            for job_id in due:
                self._deadlines.pop(job_id, None)
                await self._stop_run(job_id)
                with contextlib.suppress(NotFound):
                    await self._fail(
                        job_id, "the job did not finish before its deadline", "timeout"
                    )
            pending = [d for j, d in self._deadlines.items() if j in self._open]
            wait = None if not pending else max(0.0, (min(pending) - now) / 1000)
            await _first([self._deadline_wake.wait(), self._closing.wait()], timeout=wait)

    # -- internals: waking -------------------------------------------------------------------
    def _on_applied(self, event: StreamEventBase) -> None:
        session_id = event.session_id
        self._wake(session_id)
        if self._opened and session_id in self._open.values():
            self._spawn(self._apply_cancel_requests(session_id))

    async def _apply_cancel_requests(self, session_id: str) -> None:
        """Cancel the jobs this device runs in ``session_id`` that another device asked to
        cancel (their request arrived by sync)."""
        owned = [j for j, s in self._open.items() if s == session_id]
        if not owned:
            return
        jobs = job_states(await self._rt.store.list_events(session_id))
        for job_id in owned:
            job = jobs.get(job_id)
            if job is not None and not job.done and job.cancel_requested_by is not None:
                await self._stop_run(job_id)
                await self._update(job_id, "cancel")

    def _wake(self, session_id: str) -> None:
        for wake in self._wakes.get(session_id, ()):
            wake.set()

    def _unwake(self, session_id: str, wake: asyncio.Event) -> None:
        wakes = self._wakes.get(session_id)
        if wakes is not None:
            wakes.discard(wake)
            if not wakes:
                del self._wakes[session_id]

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background job task failed", exc_info=task.exception())

    async def _queued(self, job_id: str) -> Event:
        found = await self._rt.store.get_event(job_id)
        if found is None or found.type != QUEUED:
            raise NotFound(
                f"no job {job_id} on this device: it was never queued or has not synced here "
                "yet (sync, then ask again); nothing was written"
            )
        return found

    async def _owns(self, job: Job) -> bool:
        core = self._rt.core
        return job.owner in {core.client_id, *await core.previous_client_ids()}

    def _require_open(self) -> None:
        if not self._opened or self._closing.is_set():
            raise InvalidState("the runtime is not open: open it before starting jobs")


def _alive(runner: str) -> bool:
    """Whether the runner of an open job (``"{pid}:{instance}"``) still runs: a runtime open
    in this process, or another live process (this file's other user)."""
    if runner in _LIVE:
        return True
    pid_text, _, _ = runner.partition(":")
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    if pid == os.getpid() or pid <= 0:
        return False  # this process, and not one of its open runtimes: gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _job_summary(job: Job) -> dict[str, JSON]:
    out: dict[str, JSON] = {"job_id": job.id, "name": job.name, "status": job.status}
    if job.status == "completed":
        out["result"] = job.result
    elif job.status == "failed":
        out["error"] = job.error
    elif job.status == "cancelled":
        out["reason"] = job.cancel_reason
    else:
        out["progress"] = job.progress
        out["message"] = job.message
    return out


async def _first(waits: Sequence[Awaitable[Any]], *, timeout: float | None) -> None:
    """Wait until one of ``waits`` is done or ``timeout`` seconds pass; cancel the rest."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- built-in tools ----------------------------------------------------------------------------


async def _subagent_tool(tool_input: dict[str, JSON]) -> str:
    ctx = current_tool_call()
    if ctx is None:
        raise ToolError("the subagent tool runs inside a turn")
    tasks = ctx.rt.tasks
    try:
        result = await tasks.subagents.run_tool_call(ctx, tool_input)
    except (InvalidInput, InvalidState, NotFound) as exc:
        raise ToolError(str(exc)) from exc
    if result.outcome != "ok":
        said = f": {result.text}" if result.text else ""
        raise ToolError(f"the subagent ended with {result.outcome}{said}")
    return result.text or "(the subagent said nothing)"


async def _wait_for_jobs_tool(tool_input: dict[str, JSON]) -> str:
    ctx = current_tool_call()
    if ctx is None:
        raise ToolError("wait_for_jobs runs inside a turn")
    tasks = ctx.rt.tasks
    return await tasks.wait_for_jobs_result(ctx.session_id, tool_input)


SUBAGENT_TOOL = Tool(
    name=SUBAGENT_TOOL_NAME,
    description=(
        "Hand a self-contained task to a subagent: a separate assistant with its own "
        "conversation and tools, which answers with its result. Several subagent calls in "
        "one reply may run at once."
    ),
    input_schema={
        "type": "object",
        "properties": {
            "prompt": {"type": "string", "description": "The whole task, self-contained."},
            "title": {"type": "string", "description": "A short name for the task."},
            "tools": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Tools the subagent may use (default: yours).",
            },
        },
        "required": ["prompt"],
    },
    fn=_subagent_tool,
)
"""The model's ``subagent`` tool: register it (``SessionRuntime(tools=[SUBAGENT_TOOL])``)
and list it in a session's tools; its result is the subagent's final text."""

WAIT_FOR_JOBS_TOOL = Tool(
    name=WAIT_FOR_JOBS_TOOL_NAME,
    description=(
        "Wait until background jobs of this conversation finish and get their results "
        "(default: every job still running)."
    ),
    input_schema={
        "type": "object",
        "properties": {
            "job_ids": {"type": "array", "items": {"type": "string"}},
            "timeout_seconds": {"type": "number", "minimum": 0},
        },
    },
    fn=_wait_for_jobs_tool,
)
"""The ``wait_for_jobs`` flow-control tool: waits for the session's jobs, answers their
results as JSON (``TasksFacet.wait_for_jobs_result``)."""


def job_tool(name: str, description: str, input_schema: dict[str, JSON]) -> Tool:
    """A tool that starts a background job of kind ``name`` with the model's input and
    answers its id at once (the model calls ``wait_for_jobs`` for the result)."""

    async def start(tool_input: dict[str, JSON]) -> str:
        ctx = current_tool_call()
        if ctx is None:
            raise ToolError(f"{name} runs inside a turn")
        tasks = ctx.rt.tasks
        try:
            receipt = await tasks.start_job(ctx.session_id, name, tool_input)
        except (InvalidInput, InvalidState, NotFound) as exc:
            raise ToolError(str(exc)) from exc
        return msgspec.json.encode({"job_id": receipt.job_id, "status": receipt.status}).decode()

    return Tool(name=name, description=description, input_schema=input_schema, fn=start)


__all__ = [
    "SUBAGENT_TOOL",
    "WAIT_FOR_JOBS_TOOL",
    "JobContext",
    "JobHandler",
    "TasksFacet",
    "job_tool",
]
