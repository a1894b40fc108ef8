"""LangGraph with ``SqliteSaver`` (``langgraph-checkpoint-sqlite``); runs from ``.venv-peers``.

A graph the way LangGraph users write a chat: a state with ``messages`` and a reducer, one node
that appends the assistant's reply (the turn's 800-byte text, an ``AIMessage``), compiled with
``SqliteSaver.from_conn_string(path)`` as its checkpointer; per turn one
``graph.invoke({"messages": [HumanMessage(user_text)]}, {"configurable": {"thread_id": ...}})``
with a fixed thread, so LangGraph writes its checkpoints for the turn (default durability; one
per superstep: input, the node) and the node's writes.

Variants (``--variant``):

- ``add_messages``: ``Annotated[list, add_messages]``, the documented messages state. Every
  checkpoint stores the whole message list.
- ``delta``: ``Annotated[list, DeltaChannel(_messages_delta_reducer)]`` (LangGraph's beta
  ``DeltaChannel``: a checkpoint stores only the new writes, plus a full snapshot every 100
  updates by default; reading the state replays the writes since the last snapshot).

``python -m bench.peers.peer_langgraph --dir DIR [--turns N] [--variant add_messages|delta]``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.peers.common import (
    assistant_text,
    conversation_figures,
    emit,
    remove_db,
    turn_args,
    user_text,
    versions,
)

PACKAGES = ("langgraph", "langgraph-checkpoint", "langgraph-checkpoint-sqlite", "langchain-core")
THREAD_ID = "bench-thread"


def build_graph(variant: str) -> Any:
    from typing import Annotated, TypedDict

    from langchain_core.messages import AIMessage  # type: ignore[import-not-found,unused-ignore]
    from langgraph.graph import END, START, StateGraph  # type: ignore[import-not-found,unused-ignore]
    from langgraph.graph.message import add_messages  # type: ignore[import-not-found,unused-ignore]

    if variant == "delta":
        try:
            from langgraph.channels.delta import DeltaChannel  # type: ignore[import-not-found,unused-ignore]
            from langgraph.graph.message import (  # type: ignore[import-not-found,unused-ignore]
                _messages_delta_reducer,
            )
        except ImportError as exc:
            raise SystemExit(f"DeltaChannel is not available in this LangGraph: {exc}") from exc

        reducer: Any = _messages_delta_reducer
        channel: Any = DeltaChannel(reducer)
    elif variant == "add_messages":
        channel = add_messages
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    # Built at run time (this module's annotations are strings, and LangGraph reads the
    # state's type hints): the same as ``class State(TypedDict): messages: Annotated[...]``.
    State = TypedDict("State", {"messages": Annotated[list[Any], channel]})  # noqa: UP013

    def reply(current: dict[str, Any]) -> dict[str, Any]:
        turn = len(current["messages"]) // 2  # the user message of this turn is already in
        return {"messages": [AIMessage(content=assistant_text(turn))]}

    graph: Any = StateGraph(State)
    graph.add_node("reply", reply)
    graph.add_edge(START, "reply")
    graph.add_edge("reply", END)
    return graph


def run(turns: int, path: Path, variant: str) -> tuple[list[float], dict[str, Any]]:
    from langchain_core.messages import HumanMessage  # type: ignore[import-not-found,unused-ignore]
    from langgraph.checkpoint.sqlite import SqliteSaver  # type: ignore[import-not-found,unused-ignore]

    graph = build_graph(variant)
    config = {"configurable": {"thread_id": THREAD_ID}}
    seconds: list[float] = []
    with SqliteSaver.from_conn_string(str(path)) as saver:
        app = graph.compile(checkpointer=saver)
        for i in range(turns):
            started = time.perf_counter()
            app.invoke({"messages": [HumanMessage(content=user_text(i))]}, config)
            seconds.append(time.perf_counter() - started)
        messages = app.get_state(config).values["messages"]
        assert len(messages) == 2 * turns, len(messages)
        assert messages[-1].content == assistant_text(turns - 1)
        (checkpoints,) = saver.conn.execute("SELECT count(*) FROM checkpoints").fetchone()
        (writes,) = saver.conn.execute("SELECT count(*) FROM writes").fetchone()
    return seconds, {"checkpoints": checkpoints, "writes": writes}


def main() -> None:
    args = turn_args(__doc__.split("\n\n")[0] if __doc__ else "")
    variant = args.variant or "add_messages"
    path = args.dir / f"langgraph-{variant}.db"
    remove_db(path)
    try:
        seconds, counts = run(args.turns, path, variant)
        result = conversation_figures(seconds, path)  # the saver's connection is closed
    finally:
        remove_db(path)
    result.update(counts, variant=variant, versions=versions(*PACKAGES))
    emit(result)


if __name__ == "__main__":
    main()
