"""Spans on OpenTelemetry, for both sides: ``runtime.spans`` on a device, the server's spans.

OpenTelemetry is optional (``pip install pleach[otel]``). Without an exporter or a tracer
provider, ``Spans`` is a no-op that still counts spans in flight (the reference's
``NoopOtelExporter``), so hosts can always call it. With one, every span is a real OTel span:

::

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()               # or OTLP, console, ...
    rt = SessionRuntime(store, provider, span_exporter=exporter)

Trace context crosses the wire as a W3C ``traceparent`` string (``Push.trace``): a device's
flush span is the parent of the server's push span.

Span names: ``pleach.turn``, ``pleach.model_call``, ``pleach.tool_call``, ``pleach.subagent``,
``pleach.sync.flush``, ``pleach.sync.pull`` on a device; ``pleach.server.push`` and
``pleach.server.pull`` on the server. Attributes use ``pleach.*`` names for sessions, turns and
tenants and the OpenTelemetry GenAI names (``gen_ai.*``) for models and token counts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import msgspec

__all__ = ["MAX_TRACEPARENT", "SpanHandle", "Spans", "SpansSnapshot"]

MAX_TRACEPARENT = 128
"""The longest ``traceparent`` a frame may carry (a W3C one is 55 characters)."""

Attributes = Mapping[str, str | int | float | bool]


class SpansSnapshot(msgspec.Struct, kw_only=True):
    in_flight_count: int
    is_shutdown: bool
    exporting: bool
    """False for the no-op default: spans are counted, not exported."""


class SpanHandle:
    """One open span: set attributes, record an error, ``end()`` it (once; later calls are
    no-ops). ``traceparent`` names it for a peer (empty for a no-op span)."""

    def __init__(self, owner: Spans, span: Any | None) -> None:
        self._owner = owner
        self._span = span
        self._ended = False

    def set(self, **attributes: str | int | float | bool | None) -> None:
        if self._span is not None:
            for key, value in attributes.items():
                if value is not None:
                    self._span.set_attribute(key, value)

    def error(self, exc: BaseException | str) -> None:
        if self._span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        if isinstance(exc, BaseException):
            self._span.record_exception(exc)
            self._span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        else:
            self._span.set_status(Status(StatusCode.ERROR, exc))

    @property
    def traceparent(self) -> str:
        if self._span is None:
            return ""
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(self._span))
        return carrier.get("traceparent", "")

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self._span is not None:
            self._span.end()
        self._owner._ended()


class Spans:
    """Start, flush and shut down spans; count those in flight.

    ``exporter``: an OpenTelemetry ``SpanExporter``; this object then owns a
    ``TracerProvider`` (with ``service_name``) that exports each span as it ends.
    ``tracer_provider``: the host's own provider instead (it keeps ownership: ``shutdown``
    here does not shut it down). Neither: no-op.
    """

    def __init__(
        self,
        *,
        exporter: Any | None = None,
        tracer_provider: Any | None = None,
        service_name: str = "pleach",
    ) -> None:
        self._in_flight = 0
        self._shutdown = False
        self._provider: Any | None = None
        self._owns_provider = False
        self._tracer: Any | None = None
        if exporter is None and tracer_provider is None:
            return
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError("spans need OpenTelemetry: pip install 'pleach[otel]'") from exc
        if tracer_provider is None:
            assert exporter is not None
            tracer_provider = TracerProvider(
                resource=Resource.create({"service.name": service_name})
            )
            tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
            self._owns_provider = True
        self._provider = tracer_provider
        self._tracer = tracer_provider.get_tracer("pleach")

    @property
    def exporting(self) -> bool:
        return self._tracer is not None

    def start(
        self,
        name: str,
        *,
        kind: str | None = None,
        attributes: Attributes | None = None,
        parent: SpanHandle | None = None,
        traceparent: str = "",
    ) -> SpanHandle:
        """Open a span (end it with ``handle.end()``). Its parent: ``parent``, else the
        span a peer named in ``traceparent``, else the current span of this task."""
        self._in_flight += 1
        if self._tracer is None or self._shutdown:
            return SpanHandle(self, None)
        context = None
        if parent is not None and parent._span is not None:
            from opentelemetry.trace import set_span_in_context

            context = set_span_in_context(parent._span)
        elif traceparent:
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            context = TraceContextTextMapPropagator().extract(
                {"traceparent": traceparent[:MAX_TRACEPARENT]}
            )
        attrs: dict[str, Any] = dict(attributes or {})
        if kind is not None:
            attrs["pleach.kind"] = kind
        span = self._tracer.start_span(name, context=context, attributes=attrs)
        return SpanHandle(self, span)

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        *,
        kind: str | None = None,
        attributes: Attributes | None = None,
        parent: SpanHandle | None = None,
        traceparent: str = "",
    ) -> Iterator[SpanHandle]:
        """``start`` as a context manager: the span ends on exit, with the error if one was
        raised (a cancellation is recorded as such, then propagates)."""
        handle = self.start(
            name, kind=kind, attributes=attributes, parent=parent, traceparent=traceparent
        )
        try:
            yield handle
        except asyncio.CancelledError:
            handle.set(**{"pleach.cancelled": True})
            raise
        except BaseException as exc:
            handle.error(exc)
            raise
        finally:
            handle.end()

    def _ended(self) -> None:
        self._in_flight = max(0, self._in_flight - 1)

    async def flush(self, timeout_s: float = 30.0) -> bool:
        """Export every ended span now; False when the exporter did not finish in time."""
        if self._provider is None or self._shutdown:
            return True
        provider = self._provider
        return bool(await asyncio.to_thread(provider.force_flush, int(timeout_s * 1000)))

    async def shutdown(self) -> None:
        """Flush and stop exporting (idempotent). A host's own provider is left running."""
        if self._shutdown:
            return
        await self.flush()
        self._shutdown = True
        if self._owns_provider and self._provider is not None:
            await asyncio.to_thread(self._provider.shutdown)

    def in_flight_count(self) -> int:
        """Spans started and not yet ended."""
        return self._in_flight

    def is_shutdown(self) -> bool:
        return self._shutdown

    def snapshot(self) -> SpansSnapshot:
        return SpansSnapshot(
            in_flight_count=self._in_flight,
            is_shutdown=self._shutdown,
            exporting=self.exporting,
        )
