"""Sessions: the per-peer protocol state machines (client + server roles) and the producer's parking lot."""

from p2pworker.session.parking import ParkingLot
from p2pworker.session.reporter import (
    JobDone,
    JobKind,
    JobSettled,
    LookupAnswer,
    Reporter,
    ServeLookup,
    SessionClosed,
    SessionUp,
)
from p2pworker.session.session import (
    ALLOWED,
    LOAD_MOVES,
    MOVES,
    Abort,
    Action,
    AddDataPeer,
    Answered,
    CancelReads,
    CloseCause,
    DialLane,
    ExpectLane,
    PostRead,
    RemoveDataPeer,
    Send,
    Session,
    SessionConfig,
    SessionContext,
    State,
    close_text,
)

__all__ = [
    "ALLOWED", "LOAD_MOVES", "MOVES", "Abort", "Action", "AddDataPeer", "Answered", "CancelReads", "CloseCause",
    "DialLane", "ExpectLane", "PostRead", "RemoveDataPeer", "Send", "JobDone", "JobKind", "JobSettled",
    "LookupAnswer", "ParkingLot", "Reporter", "ServeLookup", "Session", "SessionClosed",
    "SessionConfig", "SessionContext", "SessionUp", "State", "close_text",
]
