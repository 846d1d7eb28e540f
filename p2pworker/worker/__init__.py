"""The transfer worker: one event-loop thread that owns every ring, socket, NIXL handle and session.

Rooms (one concern each; the loop calls them):

    loop.py       Worker: the event loop, commands, sessions, same-host lanes, events, shutdown, status
    peers.py      PeerBook: outbound links by address, which came up once, backoff, kept peers (no I/O)
    resolver.py   Resolver: host names resolved off the loop, with the commands that wait for them

``from p2pworker.worker import Worker`` is the entry point (``p2pworker launch``).
"""

from p2pworker.worker.loop import HOOK_ENV, Worker, boottime, install_hook, lane_end_reason, poll_timeout_s

__all__ = ["HOOK_ENV", "Worker", "boottime", "install_hook", "lane_end_reason", "poll_timeout_s"]
