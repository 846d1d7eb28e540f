"""Where a pulled prefix's time to first token goes: pull_vs_recompute's client times aligned with both workers'
trace rows, per pull.

    rm -rf /tmp/pulls && mkdir /tmp/pulls
    HOPTRACE_DIR=/tmp/pulls P2PWORKER_HOOK=benchmarks.hops.trace_hook:install \\
      PYTHONPATH=$PWD/benchmarks/hops/engine_site:$PWD \\
      .venv-vllmcpu032/bin/python benchmarks/pull_vs_recompute.py --tiers ours --arms pull_idle,local \\
      --chunks 8 --reps 8 --ttft-log /tmp/pulls/ttft.txt --plot ''
    python benchmarks/hops/pulls.py /tmp/pulls

(``benchmarks/hops/engine_site`` on PYTHONPATH also traces the engine cores' steps, engine_site/sitecustomize.py;
without it the ``finish`` hop stays whole.)

Rows of the two workers (``worker_*source*.txt``, ``worker_*puller*.txt``, from trace_hook.py) and the client's
``--ttft-log`` (send and first-token CLOCK_MONOTONIC ns, the pull's kv_request_id) are on one clock.  Per pull:

* ``intake``: request sent -> the puller's LookupKeys command taken (HTTP, tokenizing, vLLM's first scheduler pass);
* ``ask``: LookupKeys -> the source worker decodes the Lookup;
* ``serve``: that Lookup -> the source engine's AnswerLookup taken (an idle vLLM 0.32 engine is woken for it);
* ``answer``: AnswerLookup -> the puller decodes the LookupResp;
* ``submit``: LookupResp -> the puller's LoadJob taken (its scheduler's next pass: HIT, then submit_load);
* ``fetch``: LoadJob -> the JobFinished put (Fetch, Offer, the read or same-host copy);
* ``finish``: JobFinished put -> first token (the puller's promotion into its CPU tier, load to device, prefill of
  the tail).  With the engine's rows it splits into ``notice`` (-> the tier hands vLLM the finished job), ``rematch``
  (-> the connector's next lookup hits the promoted prefix in the CPU tier), ``load`` (-> the first step that runs
  the model: the device load in between), ``prefill`` (that step: the tail, the first token) and ``respond`` (-> the
  client reads the token: the API server's output path and HTTP).  A local hit splits the same way from ``to_match``
  (request sent -> the CPU tier's hit) on.

A pull in one round trip (no LookupKeys: its lookups answered at once, the load asked the source) chains
``ONE_TRIP``: ``intake`` (request sent -> the puller's LoadJob taken: HTTP, tokenizing, the first scheduler pass
that promised and submitted), ``ask`` (-> the source worker decodes the asking Fetch), ``serve`` (-> the source
engine's StoreJob taken: it pinned and parked its hits, which are offered at once; its AnswerLookup when it held
nothing; an idle 0.32 engine is woken for it), ``read`` (-> that load's JobFinished put: the reads settled), then
``finish`` as above.

Then the median of each hop and, per hop, how much of its wall time the worker threads spent on a CPU (the trace
rows carry each thread's CPU time): a hop of tens of ms with well under 1 ms of CPU was waiting for a core.
"""

from __future__ import annotations

import bisect
import glob
import os
import statistics
import sys
from dataclasses import dataclass

HOPS = ("intake", "ask", "serve", "answer", "submit", "fetch", "finish")
ONE_TRIP = ("intake", "ask", "serve", "read", "finish")  # a pull whose load asked the source (no LookupKeys)
# ``finish`` split by the puller engine's own rows (engine_site/sitecustomize.py), when the trace has them
FINISH = ("notice", "rematch", "load", "prefill", "respond")
# a local hit's time to first token split the same way: from the request sent to the CPU tier's hit, then as above
LOCAL = ("to_match", "load", "prefill", "respond")


@dataclass(frozen=True)
class Row:
    ns: int
    side: str  # S: the source's worker, P: the puller's
    tag: str
    info: tuple[str, ...]
    cpu_ns: int


def read_rows(path: str, side: str) -> list[Row]:
    """One trace file's rows "<ns> <tag> [info...] cpu=<ns>" (the workers' and the engines' share the format)."""
    rows = []
    for line in open(path):
        p = line.split()
        rows.append(Row(int(p[0]), side, p[1], tuple(p[2:-1]), int(p[-1].removeprefix("cpu="))))
    return rows


def load(trace_dir: str) -> list[Row]:
    # the puller engine core's rows (side E), if it was traced
    rows = [r for path in glob.glob(os.path.join(trace_dir, "engine_ours_puller_*.txt")) for r in read_rows(path, "E")]
    for side, pattern in (("S", "source"), ("P", "puller")):
        paths = glob.glob(os.path.join(trace_dir, f"worker_*{pattern}*.txt"))
        if len(paths) != 1:
            raise SystemExit(f"{trace_dir}: expected one worker_*{pattern}*.txt, found {len(paths)}")
        rows += read_rows(paths[0], side)
    rows.sort(key=lambda r: r.ns)
    return rows


def spans(names: tuple[str, ...], marks: tuple[int, ...]) -> dict[str, float]:
    """ms between consecutive marks (ns), named."""
    return {h: (b - a) / 1e6 for h, a, b in zip(names, marks, marks[1:])}


def engine_marks(rows: list[Row], times: list[int], start: int, until: int) -> tuple[int, int, int] | None:
    """Between ``start`` and ``until`` (the client's first token): the engine's first hit of a prefix (a ``match``
    of more than 0 tokens), the start and the end of its first step after that which ran the model (the tail's
    prefill, which makes the first token).  None when the window has none (a request that recomputed)."""
    inside = rows[bisect.bisect_left(times, start):bisect.bisect_right(times, until)]
    hit = next((r for r in inside if r.side == "E" and r.tag == "match" and r.info[1].isdigit()
                and int(r.info[1]) > 0), None)  # None: "ask again later" (a pull in flight)
    ran = hit and next((r for r in inside if r.ns >= hit.ns and r.side == "E" and r.tag == "step"
                        and r.info[0] == "1"), None)
    if ran is None:
        return None
    return hit.ns, int(ran.info[2].removeprefix("t0=")), ran.ns


def first(rows: list[Row], times: list[int], side: str, tag: str, what: str, rid: str | None = None,
          after: int = 0) -> Row | None:
    """The first row of ``side`` with ``tag`` whose info starts with ``what`` (and names ``rid``) at or after ns
    (``times``: the rows' ns, sorted, built once)."""
    i = bisect.bisect_left(times, after)
    for r in rows[i:]:
        if r.side == side and r.tag == tag and r.info and r.info[0] == what and (rid is None or rid in r.info):
            return r
    return None


def cpu_between(rows: list[Row], side: str, t0: int, t1: int) -> float:
    """CPU ms the worker of ``side`` spent in [t0, t1] by its rows' thread CPU times (0 without two rows)."""
    inside = [r.cpu_ns for r in rows if r.side == side and t0 <= r.ns <= t1]
    return (inside[-1] - inside[0]) / 1e6 if len(inside) > 1 else 0.0


Chain = tuple[tuple[str, ...], str, tuple[int, ...], Row, Row]  # hop names, the side of each inner hop, marks, ...


def two_steps(rows: list[Row], times: list[int], rid: str, sent: int) -> Chain | None:
    """The two-step pull's rows: LookupKeys, Lookup, AnswerLookup, LookupResp, LoadJob, the load's JobFinished."""
    keys = first(rows, times, "P", "cmd", "LookupKeys", rid, sent)
    lookup = keys and first(rows, times, "S", "dec", "Lookup", rid, keys.ns)
    answer = lookup and first(rows, times, "S", "cmd", "AnswerLookup", None, lookup.ns)
    resp = answer and first(rows, times, "P", "dec", "LookupResp", None, answer.ns)
    load_job = resp and first(rows, times, "P", "cmd", "LoadJob", rid, resp.ns)
    loaded = load_job and first(rows, times, "P", "evt_put", "load", None, load_job.ns)
    if not loaded:
        return None
    return HOPS, "SSPPP", (sent, keys.ns, lookup.ns, answer.ns, resp.ns, load_job.ns, loaded.ns), load_job, loaded


def one_trip(rows: list[Row], times: list[int], rid: str, sent: int) -> Chain | None:
    """The one-trip pull's rows: LoadJob, the asking Fetch at the source, its engine's AnswerLookup, the JobFinished."""
    load_job = first(rows, times, "P", "cmd", "LoadJob", rid, sent)
    fetch = load_job and first(rows, times, "S", "dec", "Fetch", rid, load_job.ns)
    # the source engine's pin: its store job for this request (offered at once), or its answer when it held nothing
    pinned = fetch and (first(rows, times, "S", "cmd", "StoreJob", rid, fetch.ns)
                        or first(rows, times, "S", "cmd", "AnswerLookup", None, fetch.ns))
    loaded = pinned and first(rows, times, "P", "evt_put", "load", load_job.info[1], pinned.ns)
    if not loaded:
        return None
    return ONE_TRIP, "SSP", (sent, load_job.ns, fetch.ns, pinned.ns, loaded.ns), load_job, loaded


def pulls(trace_dir: str) -> list[dict]:
    rows = load(trace_dir)
    times = [r.ns for r in rows]
    out = []
    for line in open(os.path.join(trace_dir, "ttft.txt")):
        sent, first_token, rid, *rest = line.split()
        arm = rest[0] if rest else "pull"  # older logs: no arm, no tier column
        tier = rest[1] if len(rest) > 1 else "ours"
        if tier != "ours":
            continue  # the in-tree tier's requests: no worker of ours traced them
        sent, first_token = int(sent), int(first_token)
        if rid == "-":  # not a pull: a local hit is split by the engine's rows, if any
            em = arm == "local" and engine_marks(rows, times, sent, first_token)
            if em:
                out.append({"rid": "-", "arm": "local", "ttft_ms": (first_token - sent) / 1e6,
                            "hops_ms": spans(LOCAL, (sent, *em, first_token))})
            continue
        chain = two_steps(rows, times, rid, sent) or one_trip(rows, times, rid, sent)
        if chain is None:
            print(f"{rid}: incomplete trace, skipped", file=sys.stderr)
            continue
        names, sides, marks, load_job, loaded = chain
        marks = (*marks, first_token)
        hops = spans(names, marks)
        cpu = {h: cpu_between(rows, side, a, b) for h, side, a, b in zip(names[1:-1], sides, marks[1:], marks[2:])}
        # the engine's collection of this load job (the LoadJob row names its job id, the fin row the ids it took)
        job = load_job.info[1]
        fin = next((r for r in rows[bisect.bisect_left(times, loaded.ns):bisect.bisect_right(times, first_token)]
                    if r.side == "E" and r.tag == "fin" and job in r.info[1:]), None)
        em = fin and engine_marks(rows, times, fin.ns, first_token)
        if em:
            hops.update(spans(FINISH, (loaded.ns, fin.ns, *em, first_token)))
        out.append({"rid": rid, "arm": arm, "ttft_ms": (first_token - sent) / 1e6,
                    "hops_ms": hops, "worker_cpu_ms": cpu})
    return out


def print_chain(names: tuple[str, ...], ps: list[dict]) -> None:
    print(("two steps" if names == HOPS else "one trip") + f": {len(ps)} pulls")
    print("pull      " + " ".join(f"{h:>8}" for h in names) + "     ttft   (ms)")
    for p in ps:
        print(f"{p['rid'][4:12]:9} " + " ".join(f"{p['hops_ms'][h]:8.1f}" for h in names) + f" {p['ttft_ms']:8.1f}")
    print("median    " + " ".join(f"{statistics.median(p['hops_ms'][h] for p in ps):8.1f}" for h in names)
          + f" {statistics.median(p['ttft_ms'] for p in ps):8.1f}")


def medians(trace_dir: str) -> dict:
    """Per chain (two steps, one trip) and for the local hits: how many, and the median ms of each hop and of TTFT
    (what ``pull_vs_recompute.py --hops`` keeps in its results file)."""
    every = pulls(trace_dir)
    out = {}
    for label, items, names in (("local", [p for p in every if p["rid"] == "-"], None),
                                *((("two_steps" if n == HOPS else "one_trip"), None, n) for n in (HOPS, ONE_TRIP))):
        if items is None:
            items = [p for p in every if p["rid"] != "-"
                     and tuple(h for h in p["hops_ms"] if h not in FINISH) == names]
        if items:
            hops = list(dict.fromkeys(h for p in items for h in p["hops_ms"]))  # in chain order
            out[label] = {"n": len(items), "ttft_ms": statistics.median(p["ttft_ms"] for p in items),
                          "hops_ms": {h: statistics.median(p["hops_ms"][h] for p in items if h in p["hops_ms"])
                                      for h in hops}}
    return out


def main(argv: list[str] | None = None) -> int:
    every = pulls((sys.argv[1:] if argv is None else argv)[0])
    ps = [p for p in every if p["rid"] != "-"]
    if not ps:
        print("no complete pull in the trace", file=sys.stderr)
        return 1
    split = [p for p in ps if "notice" in p["hops_ms"]]
    local = [p for p in every if p["rid"] == "-"]
    def medians(names: tuple[str, ...], items: list[dict]) -> str:
        return ", ".join(f"{h} {statistics.median(p['hops_ms'][h] for p in items):.1f}" for h in names)

    if split:
        print(f"the pulls' finish, by the puller engine's rows (median ms): {medians(FINISH, split)} "
              f"({len(split)} pulls)")
    if local:
        print(f"local hits, by the puller engine's rows (median ms): {medians(LOCAL, local)}; "
              f"ttft {statistics.median(p['ttft_ms'] for p in local):.1f} ({len(local)} hits)")
    for names in (HOPS, ONE_TRIP):
        chain = [p for p in ps if tuple(h for h in p["hops_ms"] if h not in FINISH) == names]
        if chain:
            print_chain(names, chain)
    slow = [(p, h) for p in ps for h in p["worker_cpu_ms"] if p["hops_ms"][h] > 20]
    for p, h in slow:
        print(f"  {p['rid'][4:12]} {h}: {p['hops_ms'][h]:.1f} ms wall, {p['worker_cpu_ms'][h]:.2f} ms of worker CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
