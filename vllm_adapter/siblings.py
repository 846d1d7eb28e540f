"""Live consumer requests per peer and request id.

Two live requests may share one ``kv_request_id`` (sampling with n > 1; orchestrators that reuse ids).  What a
request's end gives up on its peer, the rows the peer parked for that id (ConsumerDone) and the answers the peer gave
for it (AskedLookups), is shared with its siblings: it is given up when the last of them ends, so one sibling's end
neither releases the rows another is about to load nor makes it ask again.
"""

from __future__ import annotations

import collections

from vllm_adapter.roles import PDRole


class Siblings:
    def __init__(self) -> None:
        self._live: collections.Counter[tuple[str, str]] = collections.Counter()

    def started(self, role: PDRole) -> None:
        if role.kind.loads:
            self._live[(role.address, role.kv_request_id)] += 1

    def ended(self, role: PDRole) -> bool:
        """One of ``role``'s requests ended; True when it was the last live one of its peer and id (or the only
        one this tier saw start)."""
        key = (role.address, role.kv_request_id)
        left = self._live[key] - 1
        if left > 0:
            self._live[key] = left
            return False
        self._live.pop(key, None)
        return True

    def __len__(self) -> int:
        return sum(self._live.values())
