"""Config fingerprint: the fields two peers must agree on before any KV moves between them.

The adapter passes in the model/layout identity it derives from vLLM (model,
dtype, block geometry, hash seed, ...); the worker adds the region geometry and
the protocol version.  Peers exchange the fields themselves (not only the
hash), so a mismatch names every differing field with both values.
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Union

import msgspec

from p2pworker.errors import FingerprintMismatch

Scalar = Union[str, int, float, bool, None]


class Fingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    fields: dict[str, Scalar]

    @classmethod
    def build(
        cls, *, block_bytes: int, protocol_version: int, identity: Mapping[str, Scalar] | None = None
    ) -> "Fingerprint":
        f: dict[str, Scalar] = {f"model.{k}": v for k, v in sorted((identity or {}).items())}
        f["block_bytes"] = block_bytes
        f["protocol_version"] = protocol_version
        return cls(dict(sorted(f.items())))

    @property
    def digest(self) -> str:
        """A short stable hash of the fields (for logs, `inspect` and `ping`)."""
        return hashlib.sha256(msgspec.msgpack.encode(self.fields)).hexdigest()[:16]

    def diff(self, other: "Fingerprint") -> dict[str, tuple[Scalar, Scalar]]:
        keys = set(self.fields) | set(other.fields)
        missing = "<absent>"
        return {
            k: (self.fields.get(k, missing), other.fields.get(k, missing))
            for k in sorted(keys)
            if self.fields.get(k, missing) != other.fields.get(k, missing)
        }

    def check(self, remote: "Fingerprint") -> None:
        """Raise FingerprintMismatch naming every differing field, local and remote value."""
        d = self.diff(remote)
        if d:
            raise FingerprintMismatch(d)
