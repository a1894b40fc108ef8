"""A turn skips a call for each streamed chunk when nobody listens: ``StreamManager.idle``,
``EventBus.idle``, ``EventBus.types`` (with each event class's ``type``) and
``TurnContext.pending`` are plain attributes it reads instead. Each is shown here by a
generator of operations: a copy driven the same way, but asked only when the attribute says
so, delivers exactly what a copy asked every time delivers. A call's characters streamed
(``_Call.chars_out``) are summed when asked, and equal the count kept chunk by chunk."""

from __future__ import annotations

import typing
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from pleach_client.plugins import TurnContext
from pleach_client.runtime import EventBus
from pleach_client.stream import (
    CustomEvent,
    MessageComplete,
    MessageDelta,
    StreamEvent,
    StreamEventBase,
    StreamManager,
    ThinkingDelta,
)
from pleach_client.turn import _Call
from tests.factories import make_session


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _event(kind: str, session: str, message: str, text: str) -> StreamEventBase:
    if kind == "delta":
        return MessageDelta(session_id=session, message_id=message, delta=text)
    if kind == "thinking":
        return ThinkingDelta(session_id=session, message_id=message, delta=text)
    if kind == "custom":
        return CustomEvent(session_id=session, name=text)
    return MessageComplete(session_id=session, message_id=message, content=[])


_SESSIONS = st.sampled_from(["s1", "s2"])
_STREAM_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("subscribe"), st.sampled_from(["all", "messages", "updates"])),
        st.tuples(st.just("unsubscribe"), st.integers(0, 5)),
        st.tuples(st.just("throttle"), st.sampled_from([0, 50, 200])),
        st.tuples(st.just("tick"), st.sampled_from([0.01, 0.1, 0.3])),
        st.tuples(
            st.just("emit"),
            st.sampled_from(["delta", "thinking", "complete"]),
            _SESSIONS,
            st.sampled_from(["m1", "m2"]),
            st.text("ab ", min_size=1, max_size=3),
        ),
        st.tuples(st.just("flush"), st.one_of(st.none(), _SESSIONS)),
        st.tuples(st.just("clear")),
    ),
    max_size=40,
)


class _Driven:
    """A stream manager, its subscribers' deliveries, and its unsubscribe functions."""

    def __init__(self, clock: Clock) -> None:
        self.manager = StreamManager(clock=clock)
        self.got: list[tuple[int, str, str]] = []
        self.unsubscribe: list[Any] = []

    def subscribe(self, mode: Any) -> None:
        index = len(self.unsubscribe)

        def deliver(event: StreamEventBase) -> None:
            self.got.append((index, event.type, getattr(event, "delta", "")))

        self.unsubscribe.append(self.manager.subscribe(mode, deliver))


@settings(max_examples=500, deadline=None)
@given(_STREAM_OPS)
@example(  # a delta that nobody hears still starts its session's interval
    [
        ("throttle", 50),
        ("emit", "delta", "s1", "m1", "a"),
        ("subscribe", "all"),
        ("emit", "delta", "s1", "m1", "b"),
    ]
)
def test_a_stream_manager_that_says_idle_would_deliver_nothing(ops: list[tuple[Any, ...]]) -> None:
    clock = Clock()
    always, asked = _Driven(clock), _Driven(clock)
    for op in ops:
        for driven in (always, asked):
            manager = driven.manager
            match op:
                case ("subscribe", mode):
                    driven.subscribe(mode)
                case ("unsubscribe", i):
                    if i < len(driven.unsubscribe):
                        driven.unsubscribe[i]()
                case ("throttle", ms):
                    manager.set_throttle_interval(ms)
                case ("emit", kind, session, message, text):
                    if driven is always or not manager.idle:
                        manager.emit(_event(kind, session, message, text))
                case ("flush", session):
                    manager.flush(session)
                case ("clear",):
                    manager.clear()
        if op[0] == "tick":
            clock.now += op[1]
        assert asked.got == always.got
        assert asked.manager.idle == always.manager.idle
    # Idle means just that: nobody to tell, nothing held, nothing timed.
    for driven in (always, asked):
        driven.manager.flush()
        if driven.manager.idle:
            before = list(driven.got)
            driven.manager.emit(_event("delta", "s1", "m1", "x"))
            driven.manager.emit(_event("complete", "s1", "m1", ""))
            assert driven.got == before


_BUS_TYPES = st.sampled_from(["message.delta", "sync.applied", "custom.a", "*"])
_BUS_OPS = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["on", "once"]), _BUS_TYPES),
        st.tuples(st.just("off"), _BUS_TYPES, st.integers(0, 5)),
        st.tuples(st.just("emit"), st.sampled_from(["delta", "complete", "custom"])),
        st.tuples(st.just("clear")),
    ),
    max_size=40,
)


def _heard(bus: EventBus, event: StreamEventBase) -> bool:
    """What a turn asks before it calls ``emit`` (``run_turn``, inline there)."""
    heard = bus.types
    return bool(heard and (event.type in heard or "*" in heard))


def test_each_event_class_keeps_its_tag_as_its_type() -> None:
    """``type`` is a class attribute of every event class (read for each streamed chunk),
    the tag msgspec writes; a custom event's stays ``custom.<name>``."""
    for cls in typing.get_args(StreamEvent):
        if cls is CustomEvent:
            continue
        assert cls.__dict__["type"] == cls.__struct_config__.tag
    assert CustomEvent(session_id="s", name="a").type == "custom.a"


@settings(max_examples=300, deadline=None)
@given(_BUS_OPS)
def test_an_event_bus_delivers_nothing_of_a_type_it_has_no_handler_of(
    ops: list[tuple[Any, ...]],
) -> None:
    buses = {"always": EventBus(), "asked": EventBus()}
    got: dict[str, list[tuple[int, str]]] = {"always": [], "asked": []}
    handlers: dict[str, list[Any]] = {"always": [], "asked": []}
    for op in ops:
        for name, bus in buses.items():
            match op:
                case (("on" | "once") as how, kind):
                    index = len(handlers[name])

                    def handler(event: StreamEventBase, i: int = index, n: str = name) -> None:
                        got[n].append((i, event.type))

                    handlers[name].append(handler)
                    getattr(bus, how)(kind, handler)
                case ("off", kind, i):
                    if i < len(handlers[name]):
                        bus.off(kind, handlers[name][i])
                case ("emit", kind):
                    event = _event(kind, "s1", "m1", "a")
                    if name == "always" or _heard(bus, event):
                        bus.emit(event)
                case ("clear",):
                    bus.clear()
        assert got["asked"] == got["always"]
        assert buses["asked"].idle == buses["always"].idle
        assert buses["always"].idle == (not any(buses["always"]._handlers.values()))
        assert set(buses["always"].types) == {k for k, v in buses["always"]._handlers.items() if v}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("emit")),
            st.tuples(st.just("note")),
            st.tuples(st.just("drain"), st.booleans()),
        ),
        max_size=30,
    )
)
def test_a_turn_context_that_has_nothing_pending_drains_nothing(
    ops: list[tuple[Any, ...]],
) -> None:
    session = make_session()
    contexts = {
        "always": TurnContext(None, session, "t"),  # type: ignore[arg-type]
        "asked": TurnContext(None, session, "t"),  # type: ignore[arg-type]
    }
    seen: dict[str, list[Any]] = {"always": [], "asked": []}
    for step, op in enumerate(ops):
        for name, ctx in contexts.items():
            if op[0] == "emit":
                ctx.emit("progress", {"step": step})
            elif op[0] == "note":
                ctx.note("tool.progress", {"step": step})
            elif name == "always" or ctx.pending:
                record = (
                    (lambda kind, payload, n=name: seen[n].append((kind, payload)))
                    if op[1]
                    else None
                )
                seen[name].extend(e.data for e in ctx.drain(record))
        assert seen["asked"] == seen["always"]
        assert contexts["asked"].pending == contexts["always"].pending
    for ctx in contexts.values():
        if not ctx.pending:
            assert ctx.drain(lambda kind, payload: None) == []


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["text", "thinking", "tool_input"]),
            st.integers(0, 3),
            st.text(max_size=6),
        ),
        max_size=30,
    )
)
def test_a_calls_characters_summed_when_asked_equal_those_counted_each_chunk(
    chunks: list[tuple[str, int, str]],
) -> None:
    call = _Call(seq=0, started=0.0)
    counted = 0
    for kind, index, text in chunks:
        counted += len(text)
        if kind == "text":
            call.partial_text.setdefault(index, []).append(text)
        elif kind == "thinking":
            call.partial_thinking.setdefault(index, []).append(text)
        else:
            call.tool_input_chars += len(text)
    assert call.chars_out == counted
