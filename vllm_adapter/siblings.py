"""Live consumer requests per peer and request id.

Two live requests may share one ``kv_request_id`` (sampling with n > 1; orchestrators that reuse ids).  What a
request's end gives up on its peer, the rows the peer parked for that id (ConsumerDone) and the answers the peer gave
for it (AskedLookups), is shared with its siblings: it is given up when the last of them ends, so one sibling's end
neither releases the rows another is about to load nor makes it ask again.

Kept by vLLM's request id, not as a count: vLLM may build a request's context twice (when a tier's on_new_request
raised, it calls it again on a fresh context at the request's end), and a request counted twice would hold its id
for ever.
"""

from __future__ import annotations

from vllm_adapter.roles import PDRole


class Siblings:
    def __init__(self) -> None:
        self._live: dict[tuple[str, str], set[str]] = {}  # (peer address, kv_request_id) -> vLLM request ids

    def started(self, role: PDRole, req_id: str) -> None:
        if role.kind.loads:
            self._live.setdefault((role.address, role.kv_request_id), set()).add(req_id)

    def ended(self, role: PDRole, req_id: str) -> bool:
        """Request ``req_id`` of ``role`` ended; True when no other live request shares its peer and id (also when
        this tier never saw it start: a worker restart between, or a context vLLM rebuilt)."""
        key = (role.address, role.kv_request_id)
        live = self._live.get(key)
        if live is None:
            return True
        live.discard(req_id)
        if live:
            return False
        del self._live[key]
        return True

    def __len__(self) -> int:
        return sum(len(v) for v in self._live.values())
