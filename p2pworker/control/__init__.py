"""Control plane: authenticated, heartbeated links between workers (bytes in, bytes out)."""

from p2pworker.control.base import ControlTransport, LinkDown, LinkInfo, LinkState, LinkUp, Received, default_port
from p2pworker.control.zmq_control import ControlConfig, ZmqControl

__all__ = ["ControlTransport", "ControlConfig", "LinkDown", "LinkInfo", "LinkUp", "LinkState", "Received", "ZmqControl",
           "default_port"]
