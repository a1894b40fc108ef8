"""Background jobs: queued, started, progress, completed, failed, cancelled.

Layers: the pure lifecycle rules (``pleach_client.jobs``) with a Hypothesis property of any
interleaving of lifecycle events and cancel requests; jobs on one runtime (real stores);
the host's job endpoint as a real HTTP server on a loopback port (``asyncio.start_server``);
a restart with jobs running, on a real SQLite file; a job started on the laptop seen,
progressing and cancelled from the phone through a real sync server; and ``wait_for_jobs``
as the model's tool through the real anthropic SDK. Waits are on events and conditions.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pleach_client.dispatch import plan_answer
from pleach_client.jobs import (
    CANCEL_REQUESTED,
    CANCELLED,
    COMPLETED,
    FAILED,
    MAX_JOB_BYTES,
    PROGRESS,
    QUEUED,
    STARTED,
    Job,
    job_states,
    plan_recover,
    plan_update,
    queued_payload,
)
from pleach_client.runtime import SessionRuntime
from pleach_client.store.base import StorageAdapter
from pleach_client.store.sqlite import SQLiteAdapter
from pleach_client.stream import StreamEventBase
from pleach_client.tasks import WAIT_FOR_JOBS_TOOL, JobContext, JobHandler, job_tool
from shared.errors import InvalidInput, InvalidState, NotFound
from shared.records import Event
from tests import sse
from tests.factories import log_event
from tests.test_interrupts import tool_reply
from tests.test_runtime_anthropic import anthropic_provider, text_reply
from tests.test_sync_e2e import ALICE, Cluster

MODEL = sse.MODEL

# -- the pure rules ------------------------------------------------------------------------------


def _queued(by: str = "laptop", **kw: Any) -> Event:
    payload = queued_payload("render", {"frames": 3}, runner="local", deadline_ms=10_000, **kw)
    return log_event(by, QUEUED, payload)


def test_the_first_final_event_wins_and_later_ones_are_overruled() -> None:
    q = _queued()
    started = log_event("laptop", STARTED, {"job_id": q.id, "attempt": 1})
    half = log_event("laptop", PROGRESS, {"job_id": q.id, "progress": 0.5, "message": "half"})
    done = log_event("laptop", COMPLETED, {"job_id": q.id, "result": {"frames": 3}})
    late_fail = log_event("laptop", FAILED, {"job_id": q.id, "error": "boom"})
    late_progress = log_event("laptop", PROGRESS, {"job_id": q.id, "progress": 0.1})
    late_cancel = log_event("phone", CANCEL_REQUESTED, {"job_id": q.id})
    job = job_states([q, started, half, done, late_fail, late_progress, late_cancel])[q.id]
    assert job.status == "completed" and job.result == {"frames": 3} and job.progress == 1.0
    assert job.owner == "laptop" and job.finished_by == "laptop" and job.final_event_id == done.id
    assert job.overruled == [late_fail.id, late_progress.id, late_cancel.id]
    assert job.cancel_requested_by is None and job.attempt == 1 and job.done
    midway = job_states([q, started, half])[q.id]
    assert (midway.status, midway.progress, midway.message) == ("started", 0.5, "half")
    assert not midway.overdue(9_999) and midway.overdue(10_000)


def test_malformed_and_oversized_job_events_are_refused_alone() -> None:
    q = _queued()
    bad_queue = log_event("laptop", QUEUED, {"name": "", "input": {}})
    huge_input = log_event("laptop", QUEUED, {"name": "x", "input": {"a": "x" * MAX_JOB_BYTES}})
    out_of_range = log_event("laptop", PROGRESS, {"job_id": q.id, "progress": 7})
    no_id = log_event("laptop", STARTED, {"attempt": 1})
    unknown = log_event("laptop", COMPLETED, {"job_id": "no-such-job", "result": 1})
    huge_result = log_event("laptop", COMPLETED, {"job_id": q.id, "result": "x" * MAX_JOB_BYTES})
    long_error = log_event("laptop", FAILED, {"job_id": q.id, "error": "e" * 10_000})
    cancelled = log_event("laptop", CANCELLED, {"job_id": q.id, "reason": "asked"})
    events = [
        bad_queue,
        huge_input,
        q,
        out_of_range,
        no_id,
        unknown,
        huge_result,
        long_error,
        cancelled,
    ]
    states = job_states(events)
    assert list(states) == [q.id]
    job = states[q.id]
    assert job.status == "cancelled" and job.cancel_reason == "asked" and job.progress is None
    with pytest.raises(ValueError, match="over"):
        queued_payload("x", {"a": "x" * MAX_JOB_BYTES}, runner="local", deadline_ms=None)
    with pytest.raises(ValueError):
        queued_payload("", {}, runner="local", deadline_ms=None)


def test_plan_update_by_role() -> None:
    q = _queued()
    queued = job_states([q])[q.id]
    # Another device cannot write the lifecycle; it can ask to cancel.
    with pytest.raises(InvalidState, match="runs on device laptop"):
        plan_update(queued, "complete", owner=False, by="phone", result=1)
    ask = plan_update(queued, "cancel", owner=False, by="phone", reason="stop")
    assert [w[0] for w in ask.writes] == [CANCEL_REQUESTED] and ask.accepted and not ask.final
    asked = job_states([q, log_event("phone", CANCEL_REQUESTED, ask.writes[0][1])])[q.id]
    assert asked.cancel_requested_by == "phone" and asked.cancel_reason == "stop"
    again = plan_update(asked, "cancel", owner=False, by="tablet")
    assert again.writes == () and not again.accepted
    # The owner applies it, naming who asked.
    applied = plan_update(asked, "cancel", owner=True, by="laptop")
    assert applied.writes[0][0] == CANCELLED and applied.writes[0][1]["requested_by"] == "phone"
    # A host that answers before its dispatch was acknowledged: started comes first.
    done = plan_update(queued, "complete", owner=True, by="laptop", result={"ok": True})
    assert [w[0] for w in done.writes] == [STARTED, COMPLETED] and done.final
    final = job_states([q, *(log_event("laptop", k, p) for k, p in done.writes)])[q.id]
    late = plan_update(final, "fail", owner=True, by="laptop", error="x")
    assert late.writes == () and not late.accepted and late.status == "completed"
    progress = plan_update(queued, "progress", owner=True, by="laptop", progress=3, message="m")
    assert progress.writes[-1][1]["progress"] == 1.0  # clamped into [0, 1]


def test_plan_recover_never_leaves_a_job_open() -> None:
    q = _queued()
    started = log_event("laptop", STARTED, {"job_id": q.id, "attempt": 1})
    running = job_states([q, started])[q.id]
    queued = job_states([q])[q.id]
    assert plan_recover(running, now_ms=0, handler=True, resumable=True).action == "resume"
    assert plan_recover(queued, now_ms=0, handler=True, resumable=False).action == "resume"
    fail = plan_recover(running, now_ms=0, handler=True, resumable=False)
    assert (fail.action, fail.reason) == ("fail", "restart")
    none = plan_recover(running, now_ms=0, handler=False, resumable=False)
    assert none.action == "fail" and "no handler for 'render'" in none.error
    late = plan_recover(running, now_ms=10_000, handler=True, resumable=True)
    assert (late.action, late.reason) == ("fail", "timeout")
    remote = job_states([log_event("laptop", QUEUED, {**q.payload, "runner": "endpoint"})])
    [endpoint] = remote.values()
    assert plan_recover(endpoint, now_ms=0, handler=False, resumable=False).action == "redispatch"
    taken = job_states(
        [
            (e := log_event("laptop", QUEUED, {**q.payload, "runner": "endpoint"})),
            log_event("laptop", STARTED, {"job_id": e.id}),
        ]
    )[e.id]
    assert plan_recover(taken, now_ms=0, handler=False, resumable=False).action == "await"
    asked = job_states([q, started, log_event("phone", CANCEL_REQUESTED, {"job_id": q.id})])[q.id]
    assert plan_recover(asked, now_ms=0, handler=True, resumable=True).action == "cancel"


_STEP = st.one_of(
    st.tuples(st.just(STARTED), st.integers(1, 3)),
    st.tuples(st.just(PROGRESS), st.floats(0, 1)),
    st.tuples(st.just(COMPLETED), st.integers(0, 9)),
    st.tuples(st.just(FAILED), st.sampled_from(["boom", "timeout"])),
    st.tuples(st.just(CANCELLED), st.just("")),
    st.tuples(st.just(CANCEL_REQUESTED), st.sampled_from(["phone", "tablet"])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_STEP, max_size=14))
def test_any_interleaving_settles_once_and_never_moves_back(steps: list[tuple[str, Any]]) -> None:
    """Whatever order lifecycle events and cancel requests land in (devices, restarts and
    replays), a job's state only moves forward, its end is the first final event, and no
    later event changes it."""
    q = _queued()
    events = [q]
    for i, (kind, value) in enumerate(steps, start=1):
        by = value if kind == CANCEL_REQUESTED else "laptop"
        payload: dict[str, Any] = {"job_id": q.id}
        if kind == STARTED:
            payload["attempt"] = value
        elif kind == PROGRESS:
            payload["progress"] = value
        elif kind == COMPLETED:
            payload["result"] = value
        elif kind == FAILED:
            payload["error"] = value
        events.append(log_event(by, kind, payload, n=i))
    order = {"queued": 0, "started": 1, "completed": 2, "failed": 2, "cancelled": 2}
    finals = [e for e in events if e.type in (COMPLETED, FAILED, CANCELLED)]
    previous: Job | None = None
    for end in range(1, len(events) + 1):
        job = job_states(events[:end])[q.id]
        if previous is not None:
            assert order[job.status] >= order[previous.status]
            if previous.done:
                assert (job.status, job.result, job.error, job.final_event_id) == (
                    previous.status,
                    previous.result,
                    previous.error,
                    previous.final_event_id,
                )
        previous = job
    assert previous is not None
    if finals:
        assert previous.final_event_id == finals[0].id
        assert set(previous.overruled) >= {e.id for e in finals[1:]}
    else:
        assert not previous.done
    end = events.index(finals[0]) if finals else len(events)
    asked = [e for e in events[:end] if e.type == CANCEL_REQUESTED]
    assert previous.cancel_requested_by == (asked[0].client_id if asked else None)


def test_what_the_hosts_answer_means() -> None:
    assert plan_answer(202, b"").action == "started"
    assert plan_answer(200, b'{"accepted": true}').action == "started"
    done = plan_answer(200, b'{"status": "completed", "result": {"url": "x"}}')
    assert (done.action, done.result) == ("completed", {"url": "x"})
    failed = plan_answer(200, b'{"status": "failed", "error": "no GPU"}')
    assert (failed.action, failed.error) == ("failed", "no GPU")
    huge = json.dumps({"status": "completed", "result": "x" * MAX_JOB_BYTES}).encode()
    assert plan_answer(200, huge).action == "failed"
    for status in (408, 425, 429, 500, 503):
        assert plan_answer(status, b"busy").action == "retry"
    refused = plan_answer(401, b"bad token")
    assert refused.action == "refused" and "HTTP 401: bad token" in refused.error


# -- jobs on one runtime -------------------------------------------------------------------------


class Gate:
    """A job handler that reports progress, then waits for ``release`` (or is cancelled)."""

    def __init__(self, result: Any = None) -> None:
        self.release = asyncio.Event()
        self.running = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.attempts: list[int] = []
        self.result = result

    async def __call__(self, ctx: JobContext) -> Any:
        self.attempts.append(ctx.attempt)
        await ctx.progress(0.5, "halfway")
        self.running.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return self.result if self.result is not None else {"input": ctx.input}


def collect(rt: SessionRuntime, mode: str = "updates") -> list[StreamEventBase]:
    seen: list[StreamEventBase] = []
    rt.subscribe_to_stream(mode, seen.append)  # type: ignore[arg-type]
    return seen


def seen_event(
    rt: SessionRuntime, kind: str, when: Callable[[Any], bool] = lambda _: True
) -> asyncio.Event:
    flag = asyncio.Event()
    rt.events.on(kind, lambda e: flag.set() if when(e) else None)
    return flag


async def until_job(
    rt: SessionRuntime, job_id: str, wanted: Callable[[Job], bool], timeout: float = 20
) -> Job:
    """The job once ``wanted`` holds, woken by its stream events (any device's)."""
    moved = asyncio.Event()

    def on_event(event: StreamEventBase) -> None:
        if getattr(event, "job_id", None) == job_id:
            moved.set()

    rt.events.on("*", on_event)
    try:
        while True:
            moved.clear()
            job = await rt.tasks.get_job(job_id)
            if wanted(job):
                return job
            await asyncio.wait_for(moved.wait(), timeout)
    finally:
        rt.events.off("*", on_event)


async def test_a_local_job_runs_reports_progress_and_completes(adapter: StorageAdapter) -> None:
    gate = Gate()
    async with SessionRuntime(adapter, user_id="alice", meta_tool_names=()) as rt:
        rt.tasks.progress_interval = 0
        rt.tasks.register_job("render", gate)
        seen = collect(rt)
        session = await rt.create_session(provider="scripted")
        receipt = await rt.tasks.start_job(session.id, "render", {"frames": 3})
        assert receipt.status == "queued" and receipt.runner == "local"
        assert rt.get_async_task_manager() is rt.tasks
        await gate.running.wait()
        job = await rt.tasks.get_job(receipt.job_id)
        assert (job.status, job.progress, job.message) == ("started", 0.5, "halfway")
        assert [j.id for j in await rt.tasks.list_jobs(session.id)] == [receipt.job_id]
        waiting = asyncio.create_task(rt.tasks.wait_for_jobs(session.id))
        gate.release.set()
        done = await asyncio.wait_for(waiting, 10)
        assert done.done and not done.timed_out
        [finished] = done.jobs
        assert finished.status == "completed" and finished.result == {"input": {"frames": 3}}
        kinds = [e.type for e in seen if e.type.startswith("job.")]
        assert kinds == ["job.queued", "job.started", "job.progress", "job.completed"]
        assert {e.job_id for e in seen if e.type.startswith("job.")} == {receipt.job_id}  # type: ignore[attr-defined]
        assert all(e.name == "render" for e in seen if e.type.startswith("job."))  # type: ignore[attr-defined]
        assert await rt.tasks.list_jobs(session.id) == []
        assert len(await rt.tasks.list_jobs(include_finished=True)) == 1
        assert await rt.store.get_meta("jobs_open") == "{}"
        assert (await rt.events.verify_chain(session.id)).ok
        again = await rt.tasks.complete_job(receipt.job_id, {"other": 1})
        assert not again.accepted and again.final and again.event_ids == []


async def test_failures_and_bad_calls(adapter: StorageAdapter) -> None:
    async def boom(ctx: JobContext) -> Any:
        raise RuntimeError("disk full")

    async def huge(ctx: JobContext) -> Any:
        return "x" * (MAX_JOB_BYTES + 10)

    async def not_json(ctx: JobContext) -> Any:
        return object()

    handlers = [JobHandler("boom", boom), JobHandler("huge", huge), JobHandler("odd", not_json)]
    async with SessionRuntime(adapter, job_handlers=handlers, meta_tool_names=()) as rt:
        session = await rt.create_session(provider="scripted")
        ids = [(await rt.tasks.start_job(session.id, n)).job_id for n in ("boom", "huge", "odd")]
        result = await asyncio.wait_for(rt.tasks.wait_for_jobs(session.id, ids), 10)
        errors = {j.name: (j.status, j.fail_reason, j.error) for j in result.jobs}
        assert errors["boom"] == ("failed", "error", "RuntimeError: disk full")
        assert errors["huge"][0] == "failed" and "over 65,536 bytes" in str(errors["huge"][2])
        assert errors["odd"][0] == "failed" and "JSON" in str(errors["odd"][2])
        with pytest.raises(InvalidInput, match="no handler for job kind 'nobody'"):
            await rt.tasks.start_job(session.id, "nobody")
        with pytest.raises(InvalidInput, match="over"):
            await rt.tasks.start_job(session.id, "boom", {"a": "x" * MAX_JOB_BYTES})
        with pytest.raises(NotFound):
            await rt.tasks.start_job("no-such-session", "boom")
        with pytest.raises(NotFound, match="never queued"):
            await rt.tasks.get_job("no-such-job")
        with pytest.raises(InvalidInput, match="register"):
            rt.tasks.register_job("boom", boom)
        rt.tasks.max_open_jobs = 0
        with pytest.raises(InvalidState, match="max_open_jobs"):
            await rt.tasks.start_job(session.id, "boom")
    with pytest.raises(InvalidState, match="not open"):
        await rt.tasks.start_job(session.id, "boom")


async def test_cancel_stops_the_handler_and_a_deadline_fails_a_job(adapter: StorageAdapter) -> None:
    slow, stuck = Gate(), Gate()
    async with SessionRuntime(adapter, meta_tool_names=()) as rt:
        rt.tasks.register_job("slow", slow)
        rt.tasks.register_job("stuck", stuck)
        session = await rt.create_session(provider="scripted")
        a = await rt.tasks.start_job(session.id, "slow")
        await slow.running.wait()
        receipt = await rt.tasks.cancel_job(a.job_id, reason="not needed")
        assert receipt.accepted and receipt.final and receipt.status == "cancelled"
        assert slow.cancelled.is_set()
        assert receipt.job is not None and receipt.job.cancel_reason == "not needed"
        late = await rt.tasks.complete_job(a.job_id, 1)
        assert not late.accepted and late.status == "cancelled"
        b = await rt.tasks.start_job(session.id, "stuck", timeout=0.3)
        result = await asyncio.wait_for(rt.tasks.wait_for_jobs(session.id, [b.job_id]), 10)
        [job] = result.jobs
        assert (job.status, job.fail_reason) == ("failed", "timeout") and stuck.cancelled.is_set()
        short = await rt.tasks.wait_for_jobs(session.id, [a.job_id], timeout=0)
        assert short.done  # already over: no wait
        c = await rt.tasks.start_job(session.id, "stuck")
        timed = await rt.tasks.wait_for_jobs(session.id, [c.job_id], timeout=0.05)
        assert timed.timed_out and not timed.done
        abort = asyncio.Event()
        abort.set()
        aborted = await rt.tasks.wait_for_jobs(session.id, [c.job_id], abort=abort)
        assert aborted.aborted and not aborted.done
        await rt.tasks.cancel_job(c.job_id)


# -- the host's job endpoint: a real HTTP server -------------------------------------------------


@dataclass
class Posted:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class Host:
    """A host's job endpoint: HTTP/1.1 on a loopback port (``asyncio.start_server``). Each
    POST is recorded and answered by ``answer``; ``posts`` gets every one as it arrives."""

    answer: Callable[[Posted], tuple[int, bytes]]
    posts: asyncio.Queue[Posted] = field(default_factory=asyncio.Queue)
    received: list[Posted] = field(default_factory=list)
    server: asyncio.Server | None = None

    async def start(self) -> Host:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/jobs"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = (await reader.readline()).decode()
            headers: dict[str, str] = {}
            while (raw := await reader.readline()) not in (b"\r\n", b"\n", b""):
                key, _, value = raw.decode().partition(":")
                headers[key.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            posted = Posted(path=line.split()[1], headers=headers, body=json.loads(body))
            self.received.append(posted)
            status, answer = self.answer(posted)
            writer.write(
                f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(answer)}\r\nConnection: close\r\n\r\n".encode()
                + answer
            )
            await writer.drain()
            self.posts.put_nowait(posted)
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def host_factory() -> AsyncIterator[Callable[..., Any]]:
    hosts: list[Host] = []

    async def make(answer: Callable[[Posted], tuple[int, bytes]]) -> Host:
        hosts.append(await Host(answer).start())
        return hosts[-1]

    yield make
    for host in hosts:
        await host.close()


def by_name(answers: dict[str, tuple[int, bytes]]) -> Callable[[Posted], tuple[int, bytes]]:
    return lambda posted: answers[posted.body["name"]]


async def test_jobs_go_to_the_endpoint_with_the_token_and_results_come_back(
    adapter: StorageAdapter, host_factory: Callable[..., Any]
) -> None:
    host: Host = await host_factory(
        by_name(
            {
                "transcode": (202, b""),
                "thumbnail": (200, b'{"status": "completed", "result": {"url": "t.png"}}'),
                "forbidden": (401, b"bad token"),
                "broken": (200, b'{"status": "failed", "error": "no GPU"}'),
            }
        )
    )
    async with SessionRuntime(
        adapter,
        user_id="alice",
        org_id="acme",
        job_dispatch_endpoint=host.url,
        auth_token="host-secret",
        meta_tool_names=(),
    ) as rt:
        rt.tasks.progress_interval = 0
        session = await rt.create_session(provider="scripted")
        seen = collect(rt)
        jobs = {
            name: await rt.tasks.start_job(session.id, name, {"n": i})
            for i, name in enumerate(["transcode", "thumbnail", "forbidden", "broken"])
        }
        assert all(r.runner == "endpoint" for r in jobs.values())
        posted = [await asyncio.wait_for(host.posts.get(), 10) for _ in jobs]
        first = next(p for p in posted if p.body["name"] == "transcode")
        assert first.path == "/jobs" and first.headers["authorization"] == "Bearer host-secret"
        assert first.headers["idempotency-key"] == jobs["transcode"].job_id
        assert first.body["input"] == {"n": 0} and first.body["session_id"] == session.id
        assert (first.body["org_id"], first.body["user_id"]) == ("acme", "alice")
        assert first.body["client_id"] == rt.client_id and first.body["attempt"] == 1
        # The host reports back through the runtime (its HTTP handler calls these).
        transcode = jobs["transcode"].job_id
        await until_job(rt, transcode, lambda j: j.status == "started")
        progress = await rt.tasks.report_progress(transcode, 0.25, "pass 1")
        assert progress.accepted and progress.status == "started"
        done = await rt.tasks.complete_job(transcode, {"url": "movie.mp4"})
        assert done.accepted and done.final
        every = [r.job_id for r in jobs.values()]
        result = await asyncio.wait_for(rt.tasks.wait_for_jobs(session.id, every), 10)
        states = {j.name: j for j in result.jobs}
        assert states["transcode"].result == {"url": "movie.mp4"}
        assert states["thumbnail"].status == "completed"
        assert states["thumbnail"].result == {"url": "t.png"}
        assert states["forbidden"].fail_reason == "dispatch"
        assert "HTTP 401: bad token" in (states["forbidden"].error or "")
        assert (states["broken"].status, states["broken"].error) == ("failed", "no GPU")
        assert (await rt.tasks.get_job(transcode)).progress == 1.0
        kinds = [e.type for e in seen if getattr(e, "job_id", None) == transcode]
        assert kinds == ["job.queued", "job.started", "job.progress", "job.completed"]
        assert len(host.received) == 4  # one POST each: nothing was retried


async def test_dispatch_retries_what_may_pass_then_gives_up(
    adapter: StorageAdapter, host_factory: Callable[..., Any]
) -> None:
    answers = iter([(503, b"busy"), (429, b"slow down"), (202, b"")])
    host: Host = await host_factory(lambda _: next(answers))
    async with SessionRuntime(adapter, job_dispatch_endpoint=host.url, meta_tool_names=()) as rt:
        rt.tasks.dispatch_backoff = 0.01
        session = await rt.create_session(provider="scripted")
        job = await rt.tasks.start_job(session.id, "encode")
        await until_job(rt, job.job_id, lambda j: j.status == "started")
        assert len(host.received) == 3
        assert {p.headers["idempotency-key"] for p in host.received} == {job.job_id}
        await rt.tasks.fail_job(job.job_id, "the encoder crashed")
        assert (await rt.tasks.get_job(job.job_id)).error == "the encoder crashed"
    # Nothing listens: the job fails after the attempts allowed, with the reason.
    closed = await host_factory(lambda _: (202, b""))
    url = closed.url
    await closed.close()
    async with SessionRuntime(adapter, job_dispatch_endpoint=url, meta_tool_names=()) as rt:
        rt.tasks.dispatch_backoff = 0.01
        rt.tasks.dispatch_attempts = 3
        session = await rt.create_session(provider="scripted")
        job = await rt.tasks.start_job(session.id, "encode")
        [failed] = (await asyncio.wait_for(rt.tasks.wait_for_jobs(session.id), 10)).jobs
        assert failed.fail_reason == "dispatch" and "after 3 attempt(s)" in (failed.error or "")
    with pytest.raises(InvalidInput, match="http"):
        SessionRuntime(adapter, job_dispatch_endpoint="ftp://host/jobs")


# -- a restart with jobs running -----------------------------------------------------------------


async def test_a_restart_resumes_or_fails_every_job_it_left_running(
    tmp_path: Path, host_factory: Callable[..., Any]
) -> None:
    db = tmp_path / "device.db"
    host: Host = await host_factory(lambda _: (202, b""))
    index, render, orphan = Gate(), Gate(), Gate()
    first = SessionRuntime(
        SQLiteAdapter(db),
        job_handlers=[
            JobHandler("index", index, resumable=True),
            JobHandler("render", render),
            JobHandler("orphan", orphan),
        ],
        job_dispatch_endpoint=host.url,
        meta_tool_names=(),
    )
    async with first as rt:
        session = await rt.create_session(provider="scripted")
        ids = {
            name: (await rt.tasks.start_job(session.id, name, {"k": name})).job_id
            for name in ("index", "render", "orphan", "remote")
        }
        for gate in (index, render, orphan):
            await gate.running.wait()
        await asyncio.wait_for(host.posts.get(), 10)
        await until_job(rt, ids["remote"], lambda j: j.status == "started")
        assert len(await rt.tasks.list_jobs(session.id)) == 4
    # Closing stopped the handlers; the jobs are still open in the log, and listed.
    assert index.cancelled.is_set() and render.cancelled.is_set()
    resumed = Gate(result={"indexed": True})
    resumed.release.set()
    second = SessionRuntime(
        SQLiteAdapter(db),
        job_handlers=[
            JobHandler("index", resumed, resumable=True),
            JobHandler("render", Gate()),  # not resumable: failed at open
        ],
        job_dispatch_endpoint=host.url,
        meta_tool_names=(),
    )
    async with second as rt:
        waited = await asyncio.wait_for(
            rt.tasks.wait_for_jobs(session.id, [ids["index"], ids["render"], ids["orphan"]]), 10
        )
        states = {j.name: j for j in waited.jobs}
        assert states["index"].status == "completed" and states["index"].attempt == 2
        assert resumed.attempts == [2] and states["index"].result == {"indexed": True}
        assert (states["render"].status, states["render"].fail_reason) == ("failed", "restart")
        assert states["orphan"].fail_reason == "restart"
        assert "no handler for 'orphan'" in (states["orphan"].error or "")
        # The host still holds the dispatched job: it reports to the reopened runtime.
        remote = await rt.tasks.get_job(ids["remote"])
        assert remote.status == "started" and len(host.received) == 1  # not posted again
        done = await rt.tasks.complete_job(ids["remote"], {"ok": 1})
        assert done.accepted and done.final
        assert await rt.tasks.list_jobs(session.id) == []
        assert await rt.store.get_meta("jobs_open") == "{}"
        assert (await rt.events.verify_chain(session.id)).ok


async def test_a_job_queued_but_never_posted_is_posted_after_a_restart(
    tmp_path: Path, host_factory: Callable[..., Any]
) -> None:
    db = tmp_path / "device.db"
    down = await host_factory(lambda _: (503, b"down"))
    async with SessionRuntime(
        SQLiteAdapter(db), job_dispatch_endpoint=down.url, meta_tool_names=()
    ) as rt:
        rt.tasks.dispatch_backoff = 60.0  # it is still waiting to retry when the runtime closes
        session = await rt.create_session(provider="scripted")
        job = await rt.tasks.start_job(session.id, "encode")
        await asyncio.wait_for(down.posts.get(), 10)
    up = await host_factory(lambda _: (200, b'{"status": "completed", "result": 7}'))
    async with SessionRuntime(
        SQLiteAdapter(db), job_dispatch_endpoint=up.url, meta_tool_names=()
    ) as rt:
        [done] = (await asyncio.wait_for(rt.tasks.wait_for_jobs(session.id), 10)).jobs
        assert done.id == job.job_id and done.status == "completed" and done.result == 7
        assert [p.body["job_id"] for p in up.received] == [job.job_id]


async def test_a_second_runtime_on_the_file_leaves_a_live_ones_jobs_alone(tmp_path: Path) -> None:
    db = tmp_path / "device.db"
    first_gate, second_gate = Gate(result="first"), Gate(result="second")
    first = SessionRuntime(
        SQLiteAdapter(db), job_handlers=[JobHandler("sync", first_gate)], meta_tool_names=()
    )
    async with first:
        session = await first.create_session(provider="scripted")
        job = await first.tasks.start_job(session.id, "sync")
        await first_gate.running.wait()
        # Another runtime opens the same file (a second process, as `pleach chat` twice).
        second = SessionRuntime(
            SQLiteAdapter(db), job_handlers=[JobHandler("sync", second_gate)], meta_tool_names=()
        )
        async with second:
            assert (await second.tasks.get_job(job.job_id)).status == "started"
            assert not first_gate.cancelled.is_set() and not second_gate.running.is_set()
            other = await second.tasks.start_job(session.id, "sync")
            await second_gate.running.wait()
            first_gate.release.set()
            done = await asyncio.wait_for(first.tasks.wait_for_jobs(session.id, [job.job_id]), 10)
            assert done.jobs[0].result == "first" and done.jobs[0].attempt == 1
            listed = json.loads(await second.store.get_meta("jobs_open") or "{}")
            assert list(listed) == [other.job_id]  # the first's finish kept the second's entry
        # The second closed with its job running: the first leaves it (its runner is gone,
        # but recovering is for the next open) and the next runtime to open fails it.
        assert second_gate.cancelled.is_set()
    async with SessionRuntime(SQLiteAdapter(db), meta_tool_names=()) as third:
        left = await third.tasks.get_job(other.job_id)  # settled while it opened
        assert left.status == "failed" and left.fail_reason == "restart"
        assert await third.store.get_meta("jobs_open") == "{}"


async def test_two_runtimes_starting_jobs_at_once_on_one_file_keep_every_open_entry(
    tmp_path: Path,
) -> None:
    """The open-jobs list is updated inside each job's write transaction: two runtimes on one
    file starting jobs concurrently lose none of each other's entries."""
    db = tmp_path / "device.db"

    async def hold(ctx: JobContext) -> Any:
        await asyncio.Event().wait()  # runs until the runtime closes

    a = SessionRuntime(SQLiteAdapter(db), job_handlers=[JobHandler("hold", hold)])
    b = SessionRuntime(SQLiteAdapter(db), job_handlers=[JobHandler("hold", hold)])
    async with a, b:
        session = await a.create_session(provider="scripted")
        receipts = await asyncio.gather(
            *(rt.tasks.start_job(session.id, "hold") for rt in (a, b) for _ in range(10))
        )
        listed = json.loads(await a.store.get_meta("jobs_open") or "{}")
        assert set(listed) == {r.job_id for r in receipts} and len(listed) == 20


# -- two devices, a real server ------------------------------------------------------------------


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with AsyncExitStack() as stack:
        c = Cluster(tmp_path, stack)
        await c.start_server()
        try:
            yield c
        finally:
            await stack.aclose()
            if c.server is not None:
                await c.stop_server()


async def laptop_with(cluster: Cluster, *handlers: JobHandler) -> SessionRuntime:
    rt = SessionRuntime(
        SQLiteAdapter(cluster.tmp / "laptop.db"),
        user_id=ALICE.user_id,
        org_id=ALICE.org_id,
        client_id="laptop",
        job_handlers=handlers,
        meta_tool_names=(),
    )
    await cluster.stack.enter_async_context(rt)
    rt.sync.backoff_initial = 0.01
    rt.sync.backoff_max = 0.2
    rt.tasks.progress_interval = 0
    return rt


async def test_a_job_started_on_the_laptop_is_seen_on_the_phone(cluster: Cluster) -> None:
    gate = Gate(result={"pages": 12})
    laptop = await laptop_with(cluster, JobHandler("report", gate))
    phone = await cluster.device("phone")
    await cluster.online(laptop, phone)
    session = await laptop.create_session(provider="scripted")
    on_phone = collect(phone)
    progressed = seen_event(phone, "job.progress", lambda e: e.progress == 0.5)
    job = await laptop.tasks.start_job(session.id, "report", {"month": "May"})
    await asyncio.wait_for(progressed.wait(), 20)
    there = await phone.tasks.get_job(job.job_id)
    assert there.owner == "laptop" and there.status == "started"
    assert (there.progress, there.message, there.input) == (0.5, "halfway", {"month": "May"})
    assert [j.id for j in await phone.tasks.list_jobs(session.id)] == [job.job_id]
    with pytest.raises(InvalidState, match="runs on device laptop"):
        await phone.tasks.complete_job(job.job_id, {"pages": 1})  # only its owner writes it
    waiting = asyncio.create_task(phone.tasks.wait_for_jobs(session.id, [job.job_id]))
    gate.release.set()
    result = await asyncio.wait_for(waiting, 20)  # woken by the sync page, not by polling
    assert result.done and result.jobs[0].result == {"pages": 12}
    kinds = [e.type for e in on_phone if getattr(e, "job_id", None) == job.job_id]
    assert kinds == ["job.queued", "job.started", "job.progress", "job.completed"]
    assert all(e.by == "laptop" for e in on_phone if getattr(e, "job_id", None) == job.job_id)  # type: ignore[attr-defined]
    await cluster.settle(laptop, phone)
    assert await laptop.tasks.get_job(job.job_id) == await phone.tasks.get_job(job.job_id)
    [hydrated] = (await phone.resume_session(session.id)).hydrated["jobs"]
    assert hydrated["status"] == "completed" and hydrated["owner"] == "laptop"
    assert (await phone.events.verify_chain(session.id)).ok


async def test_the_phone_cancels_a_job_the_laptop_runs(cluster: Cluster) -> None:
    gate = Gate()
    laptop = await laptop_with(cluster, JobHandler("crawl", gate))
    phone = await cluster.device("phone")
    await cluster.online(laptop, phone)
    session = await laptop.create_session(provider="scripted")
    started_on_phone = seen_event(phone, "job.started")
    job = await laptop.tasks.start_job(session.id, "crawl")
    await asyncio.wait_for(started_on_phone.wait(), 20)
    cancelled = seen_event(phone, "job.cancelled")
    asked = await phone.tasks.cancel_job(job.job_id, reason="wrong site")
    assert asked.accepted and not asked.final and asked.status == "started"
    await asyncio.wait_for(cancelled.wait(), 20)
    await asyncio.wait_for(gate.cancelled.wait(), 20)
    for rt in (laptop, phone):
        state = await rt.tasks.get_job(job.job_id)
        assert state.status == "cancelled" and state.finished_by == "laptop"
        assert state.cancel_requested_by == "phone" and state.cancel_reason == "wrong site"
    again = await phone.tasks.cancel_job(job.job_id)
    assert not again.accepted and again.final


# -- the model's tools, through the real SDK -----------------------------------------------------


async def test_the_model_starts_a_job_and_waits_for_it(adapter: StorageAdapter) -> None:
    provider, api = anthropic_provider(
        [
            tool_reply(("toolu_r", "render", '{"scene": "intro"}')),
            tool_reply(("toolu_w", "wait_for_jobs", "{}")),
            text_reply("The intro is rendered."),
        ]
    )
    render = job_tool(
        "render", "Render a scene in the background", {"type": "object", "properties": {}}
    )

    async def run(ctx: JobContext) -> Any:
        return {"frames": 240, "scene": ctx.input["scene"]}

    async with SessionRuntime(
        adapter,
        provider,
        tools=[render, WAIT_FOR_JOBS_TOOL],
        job_handlers=[JobHandler("render", run)],
        meta_tool_names=(),
    ) as rt:
        session = await rt.create_session(model=MODEL)
        events = [e async for e in rt.execute_message(session.id, "render the intro")]
        assert events[-1].outcome == "ok"  # type: ignore[attr-defined]
        started = json.loads(api.sent[1]["messages"][2]["content"][0]["content"])
        [job] = await rt.tasks.list_jobs(session.id, include_finished=True)
        assert started == {"job_id": job.id, "status": "queued"}
        assert job.turn_id == events[-1].turn_id and job.tool_call_id == "toolu_r"  # type: ignore[attr-defined]
        waited = json.loads(api.sent[2]["messages"][4]["content"][0]["content"])
        assert waited["done"] is True
        assert waited["jobs"] == [
            {
                "job_id": job.id,
                "name": "render",
                "status": "completed",
                "result": {"frames": 240, "scene": "intro"},
            }
        ]
    await provider.client.close()


async def test_wait_for_jobs_as_a_meta_tool_ends_the_turn_with_the_results(
    adapter: StorageAdapter,
) -> None:
    gate = Gate(result={"ok": True})
    provider, api = anthropic_provider([tool_reply(("toolu_w", "wait_for_jobs", "{}"))])
    async with SessionRuntime(
        adapter,
        provider,
        tools=[WAIT_FOR_JOBS_TOOL],
        job_handlers=[JobHandler("build", gate)],
        meta_tool_names={"wait_for_jobs"},
    ) as rt:
        session = await rt.create_session(model=MODEL)
        await rt.tasks.start_job(session.id, "build")
        await gate.running.wait()
        turn = asyncio.create_task(
            asyncio.wait_for(_drain(rt.execute_message(session.id, "wait for the build")), 20)
        )
        called = seen_event(rt, "tool.started", lambda e: e.name == "wait_for_jobs")
        await asyncio.wait_for(called.wait(), 20)
        assert not turn.done()  # the tool call waits for the job
        gate.release.set()
        events = await turn
        assert events[-1].stopped_by == "wait_for_jobs" and len(api.sent) == 1  # type: ignore[attr-defined]
        [result] = [e for e in events if e.type == "tool.completed"]
        assert json.loads(result.output)["jobs"][0]["result"] == {"ok": True}  # type: ignore[attr-defined]
    await provider.client.close()


async def _drain(stream: Any) -> list[Any]:
    return [e async for e in stream]
