"""Messages between two workers' sessions: msgspec tagged Structs in one union, one decoder.

Authentication happens below, in the control transport: a session only ever
receives frames from a link whose peer proved the shared secret.  Limits are
part of the types (msgspec ``Meta``), so a frame that breaks them fails to
decode; :func:`decode` turns every decoding failure into
``RemoteProtocolError``.  Checks that need session context (rows inside the
peer's advertised geometry) are done by the session.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta

from p2pworker.protocol.peer_info import PeerDataInfo
from p2pworker.errors import RemoteProtocolError
from p2pworker.fingerprint import Fingerprint
from p2pworker.limits import MAX_FRAME_BYTES, MAX_JOB_KEYS, MAX_KEY_BYTES, MAX_MSG_KEYS

# 2: consumer pull (Fetch/Offer/Release) replaced producer push.  3: key lists of any length go as parts.
# 4: PeerDataInfo.same_host (a same-host peer copies from our region file).  5: it gets the file descriptors
# over a local socket (SameHostInfo.socket/token) instead of trusting an advertised pid.  6: a same-host session's
# messages may move to a local lane (Hello.lane, LaneUp; p2pworker.control.lane).  7: Done (the consumer needs nothing
# more of a request: the producer releases what it parked and nobody fetched).  8: Fetch.ask (a pull in one round trip:
# the producer asks its engine which keys it holds, pins and parks them for this round, then offers them).
PROTOCOL_VERSION = 8
# Invariant 8: a frame carries at most MAX_KEYS keys (so it stays far below MAX_FRAME_BYTES), and a round or a
# lookup of more keys goes as several frames: Fetch/Lookup parts (``part`` 0, 1, ...; ``more`` on all but the
# last), Offers in pieces (``final`` on the last), Release/LookupResp parts (``more``).  The receiver puts the
# parts together (a round or a lookup is still one job, reported once), up to MAX_JOB_KEYS keys in all.
MAX_KEYS = MAX_MSG_KEYS
# The final Offer's reason when an asking round ends at its engine's answer: the keys not offered are not held there.
# A consumer's load that fails with it fell short (the source lacks the rest), not failed (vllm_adapter/jobs.py).
NOT_HELD = "the producer's engine does not hold them"
# Other reasons a final Offer gives for keys it leaves out, that say the producer could not serve (not what it holds)
TOO_MANY_LOOKUPS = "too many lookups in flight at the producer"
FETCH_TIMED_OUT = "fetch timed out on the producer"


def ask_id(round_: int) -> int:
    """The id under which an asking round's engine is asked (ServeLookup, then AnswerLookup on the adapter's ring):
    negative, so it never meets a peer's lookup id (a Count, >= 0); rounds are unique per consumer worker."""
    return -(round_ + 1)


def is_ask(lookup_id: int) -> bool:
    """The lookup is an asking round's (a one-trip load's), not a peer's Lookup."""
    return lookup_id < 0
MAX_PARTS = MAX_JOB_KEYS // MAX_KEYS
MAX_ID_CHARS = 256
MAX_LEASE_MS = 3_600_000

Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
Key = Annotated[bytes, Meta(max_length=MAX_KEY_BYTES)]
Keys = Annotated[list[Key], Meta(max_length=MAX_KEYS)]
Row = Annotated[int, Meta(ge=0, lt=1 << 40)]
Count = Annotated[int, Meta(ge=0, lt=1 << 62)]
Part = Annotated[int, Meta(ge=0, lt=MAX_PARTS)]
Reason = Annotated[str, Meta(max_length=1024)]


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    version: int
    peer_id: Id
    data: PeerDataInfo
    fingerprint: Fingerprint
    # The dialer's key for this session's same-host lane (empty: none wanted).  Told only over this authenticated
    # link; the acceptor's handover socket accepts a lane from whoever proves it (p2pworker.data.handover).
    lane: Annotated[bytes, Meta(max_length=64)] = b""


class HelloAck(msgspec.Struct, tag="hello_ack", forbid_unknown_fields=True):
    version: int
    peer_id: Id
    accepted: bool
    data: PeerDataInfo | None = None
    fingerprint: Fingerprint | None = None
    reason: Reason = ""


class Fetch(msgspec.Struct, tag="fetch", forbid_unknown_fields=True):
    """Consumer -> producer: offer me these keys of ``request_id``; I count no read as good after ``lease_ms``.

    ``lease_ms`` is the consumer's own deadline, measured from before it sent
    this frame.  The producer pins every row it offers for this round until
    the consumer's Release or until ``lease_ms`` (plus a margin) after it
    *received* the frame, whichever comes first.  Receiving happens after
    sending, so the producer's hold ends after the consumer's deadline on any
    pair of clocks that tick at about the same rate: no clock sync needed.
    """

    request_id: Id
    round: Count
    keys: Keys
    lease_ms: Annotated[int, Meta(ge=1, le=MAX_LEASE_MS)]
    part: Part = 0  # parts of one round follow each other in order on the link
    more: bool = False  # more keys of this round follow in part + 1
    # Nothing was parked for this request in advance (symmetric sharing): once every part is in, the producer asks
    # its engine which of the keys it holds (ServeLookup), parks and offers those, and ends the round's offers when
    # its engine answered.  Keys it does not hold are never offered; the consumer's load fails them and vLLM
    # recomputes from the first key not loaded.
    ask: bool = False


class Offer(msgspec.Struct, tag="offer", forbid_unknown_fields=True):
    """Producer -> consumer: these keys of the round sit in these rows of mine, pinned; read them.

    Repeated as stores arrive.  ``final`` ends the round's offers: the keys
    never offered will not come (``reason`` says why).
    """

    request_id: Id
    round: Count
    keys: Keys
    rows: Annotated[list[Row], Meta(max_length=MAX_KEYS)]
    final: bool = False
    reason: Reason = ""


class Release(msgspec.Struct, tag="release", forbid_unknown_fields=True):
    """Consumer -> producer: none of my reads of this round can still run; ``read`` keys arrived intact.

    Unpins the round's rows at once (the lease would otherwise hold them to
    its end) and lets the producer report its store jobs.
    """

    request_id: Id
    round: Count
    read: Keys
    more: bool = False  # more read keys follow: act on the last part only


class Done(msgspec.Struct, tag="done", forbid_unknown_fields=True):
    """Consumer -> producer: my request ``request_id`` ended; I will fetch nothing more of it.

    The producer reports at once every store of that request that is parked and not leased (rows under a lease
    still wait for that round's Release or the lease's end), and stores that arrive later are not parked.  Sent when
    the consumer's vLLM request ends, whether it loaded all, some or none of what was parked (a shared prefix it
    held already is never fetched)."""

    request_id: Id


class Lookup(msgspec.Struct, tag="lookup", forbid_unknown_fields=True):
    """Which of ``keys`` do you hold?  The peer pins and parks its hits under ``request_id`` for a fetch."""

    lookup_id: Count
    request_id: Id
    keys: Keys
    part: Part = 0
    more: bool = False  # more keys of this lookup follow: answer once the last part is in


class LookupResp(msgspec.Struct, tag="lookup_resp", forbid_unknown_fields=True):
    lookup_id: Count
    present: Annotated[list[bool], Meta(max_length=MAX_KEYS)]
    more: bool = False  # more answers follow, in the order of the keys asked


class Probe(msgspec.Struct, tag="probe", forbid_unknown_fields=True):
    """``p2pworker ping``: ask for the peer's identity without opening a session."""

    version: int


class ProbeInfo(msgspec.Struct, tag="probe_info", forbid_unknown_fields=True):
    version: int
    peer_id: Id
    fingerprint: Fingerprint
    backend: Annotated[str, Meta(max_length=32)]
    num_blocks: Count
    block_bytes: Count


class LaneUp(msgspec.Struct, tag="lane_up", forbid_unknown_fields=True):
    """Sent on the control link: every later message of this session from me comes on our same-host lane."""


class Bye(msgspec.Struct, tag="bye", forbid_unknown_fields=True):
    reason: Reason = ""


Message = Union[Hello, HelloAck, Fetch, Offer, Release, Done, Lookup, LookupResp, Probe, ProbeInfo, LaneUp, Bye]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes) -> Message:
    """One typed decoder for every message; anything invalid raises RemoteProtocolError."""
    if len(frame) > MAX_FRAME_BYTES:
        raise RemoteProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        msg = _decoder.decode(frame)
    except (msgspec.MsgspecError, UnicodeDecodeError) as e:
        raise RemoteProtocolError(f"undecodable frame: {e}") from None
    if isinstance(msg, Offer) and len(msg.keys) != len(msg.rows):
        raise RemoteProtocolError(f"offer {msg.request_id!r}: {len(msg.keys)} keys but {len(msg.rows)} rows")
    return msg
