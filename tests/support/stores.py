"""Store wrappers for tests: a real store with one kind of call made to fail."""

from __future__ import annotations

from typing import Any

from runtime.errors import StoreUnavailable


class AppendsOut:
    """The store, out for appends while ``down`` (loads still answer: the store came
    back for readers first, or only the writes go to a server that is out)."""

    def __init__(self, inner: Any, down: bool = False) -> None:
        self.inner, self.down = inner, down

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def append(self, *args: Any, **kwargs: Any) -> Any:
        if self.down:
            raise StoreUnavailable("out for appends (test)")
        return await self.inner.append(*args, **kwargs)
