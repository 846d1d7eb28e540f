"""What the adapter and its worker say to each other over the shared-memory rings.

Commands go adapter -> worker on the command ring; events go worker -> adapter
on the event ring.  Both are msgspec tagged Structs decoded by one typed
decoder each.  Job ids and lookup ids are the adapter's; the worker reports
each job it accepted exactly once (``JobFinished``).
"""

from __future__ import annotations

from typing import Union

import msgspec

from p2pworker.limits import MAX_JOB_KEYS, RING_MAX_MESSAGE_BYTES  # noqa: F401  (the adapter checks against them)
# a load that fell short says NOT_HELD (vllm_adapter/jobs.py); a PeerLookup whose id is_ask is a one-trip load's
from p2pworker.protocol.messages import NOT_HELD, is_ask  # noqa: F401
# a load or lookup that never reached its peer starts with one of PEER_DOWN; one its peer failed, with one of
# PEER_FAILED (vllm_adapter/hints.py: only those make a source ask first)
from p2pworker.session.client import PEER_DOWN, PEER_FAILED  # noqa: F401
# one enum for a job's kind on both sides of the rings: the adapter's jobs, the worker's ledger, JobFinished.kind
from p2pworker.session.reporter import JobKind  # noqa: F401
from p2pworker.shm.region import RegionHandle

Scalar = Union[str, int, float, bool, None]

# The rings' contract: the commands and events below and what each means.  The adapter and its worker can be
# different p2pworker releases (an operator-launched worker, `rings`: another image, another install), so each side
# says its RING_API (AttachRegion.api, Ready.api) and refuses any other: an older worker would otherwise drop a
# command it cannot decode (ResetCache, say: vLLM's reset would then wait out the whole drain bound and kill the
# worker).  0 is a release from before this field.  Bump it whenever a command or event is added or changes meaning.
# The check needs AttachRegion itself to decode on the other side: its RegionHandle forbids unknown fields, so a
# field added there makes an older worker fail to decode it, which the worker reports as this same mismatch
# (an undecodable command before any region is attached).
RING_API = 5  # 2: ConsumerDone; ResetCache.loads.  3: LoadJob.ask.  4: AttachRegion.deferred_release, RowsSettled.
# 5: PeerUp.address


def ring_api_mismatch(theirs: int, who: str) -> str | None:
    """Why ``who`` (speaking ring API ``theirs``) cannot be talked to, or None when it speaks ours."""
    if theirs == RING_API:
        return None
    what = "a release from before the ring API was versioned" if theirs == 0 else f"ring API {theirs}"
    return (f"{who} is {what}; this p2pworker speaks ring API {RING_API}: install the same p2pworker release "
            f"in vLLM's environment and the worker's")


# ---------------------------------------------------------------- commands
class AttachRegion(msgspec.Struct, tag="attach_region"):
    """The KV region to map and register; ``identity`` feeds the config fingerprint."""

    handle: RegionHandle
    identity: dict[str, Scalar] = {}
    api: int = 0  # the adapter's RING_API (0: a release before it was sent)
    # The adapter's vLLM takes a failed load before our reads into its rows settled (vLLM 0.34's
    # JobResult.deferred_release): such a load is reported at once with JobFinished.settled False, and RowsSettled
    # follows once no byte of it can land.  False: a load is reported only once its reads settled (invariant 7).
    deferred_release: bool = False


class OpenSession(msgspec.Struct, tag="open_session"):
    address: str  # host:port of the peer worker's control socket
    # True: a listed peer, re-opened whenever its session ends.  False: open it now, once (the adapter saw a request
    # that will load from it: the handshake runs while vLLM schedules, not after its first load is submitted).
    keep: bool = True


class CloseSession(msgspec.Struct, tag="close_session"):
    address: str


class StoreJob(msgspec.Struct, tag="store"):
    """Producer: park ``rows`` (holding ``keys``) for ``request_id`` until a consumer fetches them."""

    job_id: int
    request_id: str
    keys: list[bytes]
    rows: list[int]


class LoadJob(msgspec.Struct, tag="load"):
    """Consumer: have the worker at ``address`` write ``keys`` of ``request_id`` into our ``rows``."""

    job_id: int
    address: str
    request_id: str
    keys: list[bytes]
    rows: list[int]
    # A symmetric pull in one round trip: nothing was looked up or parked at the peer first; its worker asks its
    # engine for the keys when our Fetch arrives (protocol Fetch.ask), and the load brings what the peer holds.
    ask: bool = False


class LookupKeys(msgspec.Struct, tag="lookup"):
    """Symmetric sharing: ask the worker at ``address`` which keys it holds for our ``request_id``."""

    lookup_id: int
    address: str
    request_id: str
    keys: list[bytes]


class AnswerLookup(msgspec.Struct, tag="answer_lookup"):
    peer_id: str
    lookup_id: int
    present: list[bool]


class RequestFinished(msgspec.Struct, tag="request_finished"):
    request_id: str


class ConsumerDone(msgspec.Struct, tag="consumer_done"):
    """A consumer request of ours ended (loaded, recomputed or aborted): the worker at ``address`` may release
    whatever it parked for ``request_id`` and we did not fetch (a shared prefix we held already, say).  Without it
    those rows stay pinned in that engine until its park_timeout_s, and its vLLM cannot drain."""

    address: str
    request_id: str


class ResetCache(msgspec.Struct, tag="reset_cache"):
    """vLLM resets its cache (sleep, weight update; the tier's ``drain_jobs``): the rows of our open jobs go back to
    vLLM.  Every parked request no consumer can be reading (no lease) is failed at once; one under a lease ends with
    its lease (its offered rows stay pinned until then).  Every load is cancelled: reported failed once its reads
    settled (none is aborted mid-copy).  Later work is served as usual."""

    reason: str = "vLLM reset its cache"
    # False: parked stores only (vLLM drains for shutdown: its requests in flight still finish, loads included)
    loads: bool = True


class Drain(msgspec.Struct, tag="drain"):
    """Stop accepting work; report ``Drained`` once nothing is in flight."""


class Shutdown(msgspec.Struct, tag="shutdown"):
    reason: str = ""


Command = Union[AttachRegion, OpenSession, CloseSession, StoreJob, LoadJob, LookupKeys, AnswerLookup,
                RequestFinished, ConsumerDone, ResetCache, Drain, Shutdown]


# ---------------------------------------------------------------- events
class Ready(msgspec.Struct, tag="ready"):
    node_id: str
    address: str  # where peers reach this worker
    backend: str  # data backend in use
    fingerprint: str  # digest
    admin: str  # admin endpoint
    api: int = 0  # the worker's RING_API (0: a release before it was sent)
    # the longest a job can stay open in this worker once nothing new arrives (session.longest_hold_s of its own
    # settings, which for an operator-launched worker come from its config, not the tier's): drain_jobs' bound
    hold_s: float = 0.0


class JobFinished(msgspec.Struct, tag="job_finished"):
    job_id: int
    kind: str
    success: bool  # every key of the job moved
    keys: list[bytes]  # on a failure, the keys that did move (a partial load); on success empty: not echoed back
    nbytes: int
    seconds: float
    reason: str = ""
    # False (only where AttachRegion.deferred_release): a failed load whose cancelled reads may still land in the
    # rows of its failed keys; RowsSettled(job_id) says when they no longer can
    settled: bool = True


class RowsSettled(msgspec.Struct, tag="rows_settled"):
    """A load reported with ``settled`` False: none of its reads can land in its rows any more (each settled or was
    cancelled, or the session's Abort ended this worker first).  vLLM may reuse those rows from now on."""

    job_id: int


class LookupResult(msgspec.Struct, tag="lookup_result"):
    lookup_id: int
    present: list[bool] | None
    reason: str = ""


class PeerLookup(msgspec.Struct, tag="peer_lookup"):
    """A peer asks which keys we hold: answer with AnswerLookup."""

    peer_id: str
    lookup_id: int
    request_id: str  # the asking consumer's kv_request_id: park the hits under it
    keys: list[bytes]


class PeerUp(msgspec.Struct, tag="peer_up"):
    peer_id: str
    address: str = ""  # the address the adapter named (host:port), when our worker dialed it; "" when the peer dialed


class PeerDown(msgspec.Struct, tag="peer_down"):
    peer_id: str
    reason: str


class WorkerError(msgspec.Struct, tag="error"):
    message: str
    fatal: bool = False  # a configuration error (e.g. the data plane cannot run): restarting will not help
    attach: bool = False  # the region could not be attached: this worker cannot serve


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Sent every HEARTBEAT_S by a worker whose loop runs: a live pid alone does not prove that."""

    seq: int


class Drained(msgspec.Struct, tag="drained"):
    pass


Event = Union[Ready, JobFinished, RowsSettled, LookupResult, PeerLookup, PeerUp, PeerDown, WorkerError, Drained,
              Heartbeat]

HEARTBEAT_S = 0.5  # the worker loop wakes at least every tick_s (50 ms), so this costs nothing extra

RING_NSLOTS = 256
# Invariant 8: a message spans as many slots as it needs, up to RING_MAX_MESSAGE_BYTES (p2pworker.limits).
RING_SLOT_BYTES = 64 * 1024  # one slot holds a job of ~1,500 keys of 32 bytes; larger ones span slots


def ring_names(prefix: str) -> tuple[str, str]:
    """(command ring, event ring) names for a worker's ring prefix."""
    return f"{prefix}.cmd", f"{prefix}.evt"
