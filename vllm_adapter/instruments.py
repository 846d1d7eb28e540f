"""Named points where benchmark and test code may watch or change what the tier does in vLLM's process.

The tier calls its ``instruments`` (a ``TierInstruments``; the default does nothing and vetoes nothing) here, and
nowhere else lets outside code in.  Code that has the tier object (``manager.secondary_tiers[i]``) sets
``tier.instruments`` to its own subclass; it names only these points, so renaming a tier method cannot silently
cut it off.

    point          when                                                        may
    on_pump        vLLM called in and the tier is about to collect the         watch it (which thread, how often)
                   worker's events (get_finished_jobs, drain_jobs; not the
                   start wait in __init__, before outside code has the tier)
    on_open_ahead  a request that will load from ``address`` arrived; the      return False: the session is opened
                   tier is about to have the worker open that session now      by the first load instead
"""

from __future__ import annotations


class TierInstruments:
    """The tier's instrument points; each does nothing here.  Subclass and override what you need."""

    def on_pump(self) -> None:
        """The tier is about to collect its worker's events."""

    def on_open_ahead(self, address: str) -> bool:
        """A loading request's peer at ``address``: True (the default) opens its session ahead of the first load."""
        return True
