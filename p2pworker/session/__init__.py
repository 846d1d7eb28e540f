"""Sessions: the per-peer protocol state machines (client + server roles) and the producer's parking lot."""

from p2pworker.session.parking import ParkingLot
from p2pworker.session.reporter import JobDone, LookupAnswer, Reporter, ServeLookup, SessionClosed, SessionUp
from p2pworker.session.session import (
    ALLOWED,
    LOAD_MOVES,
    Action,
    AddDataPeer,
    CancelReads,
    DialLane,
    ExpectLane,
    PostRead,
    RemoveDataPeer,
    Send,
    Session,
    SessionConfig,
    SessionContext,
    State,
)

__all__ = [
    "ALLOWED", "LOAD_MOVES", "Action", "AddDataPeer", "CancelReads", "DialLane", "ExpectLane",
    "PostRead", "RemoveDataPeer", "Send", "JobDone",
    "LookupAnswer", "ParkingLot", "Reporter", "ServeLookup", "Session", "SessionClosed",
    "SessionConfig", "SessionContext", "SessionUp", "State",
]
