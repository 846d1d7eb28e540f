"""Session protocol messages: typed, versioned, validated on decode.  No I/O."""

from p2pworker.protocol.messages import (
    PROTOCOL_VERSION,
    Bye,
    Fetch,
    Hello,
    HelloAck,
    Lookup,
    LookupResp,
    Message,
    Offer,
    Probe,
    ProbeInfo,
    Release,
    decode,
    encode,
)

__all__ = [
    "PROTOCOL_VERSION", "Bye", "Fetch", "Hello", "HelloAck", "Lookup",
    "LookupResp", "Message", "Probe", "ProbeInfo", "Offer", "Release", "decode", "encode",
]
