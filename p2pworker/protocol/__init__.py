"""Session protocol messages: typed, versioned, validated on decode.  No I/O."""

from p2pworker.protocol.messages import (
    PROTOCOL_VERSION,
    AbortAck,
    AbortFetch,
    Bye,
    Fetch,
    Hello,
    HelloAck,
    Lookup,
    LookupResp,
    Message,
    Probe,
    ProbeInfo,
    TransferDone,
    decode,
    encode,
)

__all__ = [
    "PROTOCOL_VERSION", "AbortAck", "AbortFetch", "Bye", "Fetch", "Hello", "HelloAck", "Lookup",
    "LookupResp", "Message", "Probe", "ProbeInfo", "TransferDone", "decode", "encode",
]
