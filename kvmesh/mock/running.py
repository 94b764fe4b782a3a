"""The requests in the engine by the id an abort API names them by: the server's id for vLLM's
``abort_requests`` (:mod:`kvmesh.mock.tokens_api`), the client's ``rid`` for SGLang's
``/abort_request`` (:mod:`kvmesh.mock.sglang_abort`).

The engine knows its requests by ids of its own (one per choice); a client aborts by the id its
API gave it, which covers every choice of the request. A request is here from its submission until
its answer is over (whole, or its stream closed), as the servers keep their request states.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from kvmesh.mock.engine import TokenStream


class RunningRequests:
    """Requests by id, each its choices' engine streams. Several requests may share an id (a
    client's id sent twice): an abort stops them all. A request without an id (``None``) is not
    kept: no abort by id reaches it."""

    def __init__(self) -> None:
        self._by_id: dict[str, list[list[TokenStream]]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def add(self, request_id: str | None, streams: list[TokenStream]) -> None:
        if request_id is not None:
            self._by_id.setdefault(request_id, []).append(streams)

    def remove(self, request_id: str | None, streams: list[TokenStream]) -> None:
        """Forget a request whose answer is over (again: nothing)."""
        entries = None if request_id is None else self._by_id.get(request_id)
        if request_id is None or entries is None:
            return
        for i, entry in enumerate(entries):
            if entry is streams:
                del entries[i]
                break
        if not entries:
            del self._by_id[request_id]

    def streams(self, request_ids: Iterable[str]) -> list[TokenStream]:
        """The engine streams of the requests ``request_ids`` name (unknown ids name none)."""
        return [s for rid in request_ids for entry in self._by_id.get(rid, ()) for s in entry]

    def prefixed(self, prefix: str) -> list[TokenStream]:
        """The engine streams of the requests whose id starts with ``prefix``."""
        return self.streams([rid for rid in self._by_id if rid.startswith(prefix)])

    async def until_sent(
        self, request_id: str | None, streams: list[TokenStream], chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """``chunks``, the request forgotten once they are sent (or the stream is closed early)."""
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.remove(request_id, streams)
