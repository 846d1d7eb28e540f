"""The one way a session machine changes state: look the move up in its table.

Each machine (a session's connection :class:`~p2pworker.session.core.State`, a load's
:class:`~p2pworker.session.client.LoadPhase`, a lease's :class:`~p2pworker.session.parking.LeasePhase`) has a
``dict[(state, event), next state]``; the code assigns a state only through :func:`move`, so the table is the whole
machine and the tests read it (each row exercised, a move outside it refused).
"""

from __future__ import annotations

import enum
from typing import Mapping, TypeVar

from p2pworker.errors import LocalProtocolError

S = TypeVar("S", bound=enum.Enum)


class IllegalMove(LocalProtocolError):
    """A move its machine's table does not have: a bug on our side (what a peer sends is filtered before it can
    drive one, by ``ALLOWED`` and the handlers' checks)."""


def move(table: Mapping[tuple[S, enum.Enum], S], state: S, event: enum.Enum) -> S:
    """The state ``event`` takes ``state`` to, per ``table``; :class:`IllegalMove` when the table has no such move."""
    try:
        return table[(state, event)]
    except KeyError:
        raise IllegalMove(f"{type(state).__name__}.{state.name} has no move on {type(event).__name__}.{event.name}"
                          ) from None
