"""Control plane: authenticated, heartbeated links between workers (bytes in, bytes out)."""

from p2pworker.control.base import ControlTransport, LinkDown, LinkUp, Received, default_port
from p2pworker.control.zmq_control import ControlConfig, LinkState, ZmqControl

__all__ = ["ControlTransport", "ControlConfig", "LinkDown", "LinkUp", "LinkState", "Received", "ZmqControl",
           "default_port"]
