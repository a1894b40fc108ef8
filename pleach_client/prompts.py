"""Prompt fragments: the system prompt of every model call, assembled from contributions.

A ``PromptFragment`` is a piece of system prompt with an id, an origin (``"core"``, ``"host"``
or the contributing plugin's name), an ``order`` and an optional ``when`` (a predicate on
the ``PromptContext``: the fragment is included only when it applies). Each model call's
system prompt is the runtime's ``system`` (if any) followed by the applicable fragments in
order, separated by blank lines.

``seed_core_defaults=True`` (the default) seeds the core fragments. Each says only what this
runtime does, and each is included only when it applies:

- ``core.tool_results`` (when the session offers tools): what an error tool result means.
- ``core.approval`` (when an ``InterruptConfig`` is enabled): rejected calls and their reasons.
- ``core.flow_control`` (when the session offers flow-control tools, ``meta_tool_names``):
  calling one ends the turn.

``rt.prompts`` lists them (``list``, ``get``, ``get_all``, ``list_by_origin``); a host adds its
own with ``rt.prompts.register`` (``replace=True`` replaces a fragment of the same id).
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.records import Session

if TYPE_CHECKING:
    from .runtime import SessionRuntime

log = logging.getLogger("pleach.prompts")

__all__ = ["CORE_FRAGMENTS", "PromptContext", "PromptFragment", "PromptsFacet"]


@dataclass(frozen=True)
class PromptContext:
    """What a fragment may depend on: the session and what this call offers the model."""

    session: Session
    tools: tuple[str, ...]
    """The tools the call offers (registered and enabled for the session)."""
    meta_tools: tuple[str, ...]
    """The flow-control tools among them (``meta_tool_names``)."""
    approvals: bool
    """Whether tool calls may wait for a person's decision (an enabled ``InterruptConfig``)."""


@dataclass(frozen=True)
class PromptFragment:
    """A piece of system prompt. ``text`` is a string or a function of the ``PromptContext``;
    ``when`` (None: always) says whether the fragment applies to a call."""

    id: str
    text: str | Callable[[PromptContext], str]
    origin: str = "host"
    order: int = 100
    when: Callable[[PromptContext], bool] | None = None
    description: str = ""

    def render(self, ctx: PromptContext) -> str | None:
        """The fragment's text for ``ctx``, or None when it does not apply."""
        if self.when is not None and not self.when(ctx):
            return None
        text = self.text(ctx) if callable(self.text) else self.text
        return text.strip() or None


def _flow_control(ctx: PromptContext) -> str:
    names = ", ".join(ctx.meta_tools)
    text = (
        f"The tools {names} are flow-control signals: calling one ends your turn once its "
        "result is in, so make it your last call."
    )
    if "set_step_complete" in ctx.meta_tools:
        text += " Call set_step_complete when the task you were given is done."
    return text


CORE_FRAGMENTS: tuple[PromptFragment, ...] = (
    PromptFragment(
        id="core.tool_results",
        origin="core",
        order=10,
        when=lambda ctx: bool(ctx.tools),
        text=(
            "Tool results come from the runtime that runs your tool calls. A result marked as "
            "an error means the call failed, was refused by a policy or was not run: read its "
            "text before calling again, and do not repeat a failed call unchanged."
        ),
        description="what an error tool result means (when the session offers tools)",
    ),
    PromptFragment(
        id="core.approval",
        origin="core",
        order=20,
        when=lambda ctx: ctx.approvals and bool(ctx.tools),
        text=(
            "Some tool calls wait for a person to approve them before they run. When a call "
            "was rejected, its result gives the reason: take it into account and do not make "
            "the same call again unless asked to."
        ),
        description="rejected tool calls (when an InterruptConfig is enabled)",
    ),
    PromptFragment(
        id="core.flow_control",
        origin="core",
        order=30,
        when=lambda ctx: bool(ctx.meta_tools),
        text=_flow_control,
        description="flow-control tools end the turn (when the session offers them)",
    ),
)
"""The core fragments ``seed_core_defaults`` seeds (see the module docstring)."""


class PromptsFacet:
    """``runtime.prompts``: the prompt fragments every model call's system prompt is built
    from (the core ones, the host's, and plugins')."""

    def __init__(self, rt: SessionRuntime, *, seed_core_defaults: bool = True) -> None:
        self._rt = rt
        self._fragments: dict[str, PromptFragment] = {}
        if seed_core_defaults:
            for fragment in CORE_FRAGMENTS:
                self.register(fragment)

    def register(self, fragment: PromptFragment, *, replace: bool = False) -> PromptFragment:
        """Add a fragment; ``ValueError`` if its id is taken, unless ``replace``."""
        if fragment.id in self._fragments and not replace:
            raise ValueError(
                f"prompt fragment {fragment.id!r} is already registered (by "
                f"{self._fragments[fragment.id].origin!r}); pass replace=True to replace it"
            )
        self._fragments[fragment.id] = fragment
        return fragment

    def list(self) -> builtins.list[str]:
        """The ids of every fragment, in the order they are assembled."""
        return [f.id for f in self.get_all()]

    def get(self, fragment_id: str) -> PromptFragment | None:
        return self._fragments.get(fragment_id)

    def get_all(self) -> builtins.list[PromptFragment]:
        """Every fragment, in the order they are assembled (``order``, then id)."""
        return sorted(self._fragments.values(), key=lambda f: (f.order, f.id))

    def list_by_origin(self, origin: str) -> builtins.list[PromptFragment]:
        """The fragments of one origin: ``"core"``, ``"host"`` or a plugin's name."""
        return [f for f in self.get_all() if f.origin == origin]

    def context(self, session: Session) -> PromptContext:
        """The context a model call of ``session`` is assembled for."""
        rt = self._rt
        tools = tuple(t.name for t in rt.tools.specs(session.tools))
        meta = rt.plugins.meta_tool_names
        config = rt.interrupt
        return PromptContext(
            session=session,
            tools=tools,
            meta_tools=tuple(t for t in tools if t in meta),
            approvals=config is not None and config.enabled,
        )

    def compose(self, session: Session) -> str | None:
        """The system prompt of a model call of ``session``: the runtime's ``system``, then
        each applicable fragment in order (None when there is nothing). A fragment whose
        function raises is left out (and logged): a plugin's bug must not stop the turn."""
        ctx = self.context(session)
        parts = [self._rt.system] if self._rt.system else []
        for fragment in self.get_all():
            try:
                text = fragment.render(ctx)
            except Exception:
                log.exception("prompt fragment %r failed; it is left out", fragment.id)
                continue
            if text:
                parts.append(text)
        return "\n\n".join(parts) if parts else None

    def register_all(self, fragments: Iterable[PromptFragment]) -> None:
        for fragment in fragments:
            self.register(fragment)
