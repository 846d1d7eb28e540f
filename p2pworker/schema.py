"""Constrained value types of the settings schema (msgspec checks them when a file, JSON or flag sets a value).

The settings themselves are msgspec Structs next to the code they configure: ``ControlConfig``
(p2pworker/control/zmq_control.py), ``SessionConfig`` (p2pworker/session/session.py), ``DataConfig`` and
``WorkerConfig`` (p2pworker/config.py), and the tier's ``TierSettings`` (p2pworker/config.py).
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

Pos = Annotated[float, Meta(gt=0)]  # an interval or timeout: zero or less is a mistake
NonNeg = Annotated[float, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
Port = Annotated[int, Meta(ge=0, le=65535)]  # 0: any free port
Lease = Annotated[float, Meta(gt=0, le=3600)]  # a lease a producer may grant (protocol MAX_LEASE_MS)
DPIndex = Annotated[int, Meta(ge=0, le=4095)]
