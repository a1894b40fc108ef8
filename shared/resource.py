"""``AsyncResource``: ``async with`` for anything with ``open()`` and ``close()``."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class AsyncResource:
    """Mixin: ``async with x`` opens ``x`` and closes it on the way out, whatever happens.

    Subclasses define ``open()`` and ``close()``; ``close()`` must be idempotent and should
    shield its own cleanup from cancellation.
    """

    async def open(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
