"""Align the trace rows of pd_tier's four processes per block (two schedulers, two workers) by request; per-hop
median/p90 in us over warm requests.

    python benchmarks/hops/analyze.py TRACE_DIR
Blocks: sched_{P,D}_<pid>.txt pair with worker_vllm-pdbenchours{P,D}<pid>.txt; the P and D of one block are
matched by time overlap.  The first request of each block (cold) is skipped.
"""
import glob
from collections import Counter
import re
import statistics
import sys

D_ = sys.argv[1]


def load(path):
    out = []
    for line in open(path):
        p = line.split()
        out.append((int(p[0]), *p[1:]))
    return out


def blocks():
    res = []
    for role in "PD":
        for f in glob.glob(f"{D_}/sched_{role}_*.txt"):
            pid = re.search(r"_(\d+)\.txt$", f).group(1)
            w = f"{D_}/worker_vllm-pdbenchours{role}{pid}.txt"
            res.append((role, load(f), load(w)))
    Ps = sorted([b for b in res if b[0] == "P"], key=lambda b: b[1][0][0])
    Ds = sorted([b for b in res if b[0] == "D"], key=lambda b: b[1][0][0])
    return list(zip(Ps, Ds))


def cpu(e):
    for x in e[2:]:
        if isinstance(x, str) and x.startswith("cpu="):
            return int(x[4:])
    raise ValueError(e)


def first(tr, t0, t1, tag, *args):
    for e in tr:
        if t0 <= e[0] < t1 and e[1] == tag and all(a is None or (len(e) > i + 2 and e[i + 2] == a)
                                                    for i, a in enumerate(args)):
            return e
    return None


def last(tr, t0, t1, tag, *args):
    r = None
    for e in tr:
        if e[0] >= t1:
            break
        if t0 <= e[0] and e[1] == tag and all(a is None or (len(e) > i + 2 and e[i + 2] == a)
                                              for i, a in enumerate(args)):
            r = e
    return r


H = {}
X = {}


def add(k, v):
    H.setdefault(k, []).append(v / 1000)


def cnt(k, v):
    X.setdefault(k, []).append(v)


def sleep_before(tr, t):
    """(asleep us, timeout us, woke how long before t) of the last sleep that ended before t."""
    s1 = last(tr, 0, t, "sleep1")
    if s1 is None:
        return None
    s0 = last(tr, 0, s1[0], "sleep0")
    return (s1[0] - s0[0]) / 1000, int(s1[2]), (t - s1[0]) / 1000


for (_, PS, PW), (_, DS, DW) in blocks():
    rids = []
    for e in DS:
        if e[1] == "lk0" and e[2] not in rids:
            rids.append(e[2])
    for rid in rids[1:]:  # warm only
        lk0s = [e for e in DS if e[1] == "lk0" and e[2] == rid]
        lk1s = [e for e in DS if e[1] == "lk1" and e[2] == rid]
        t_start, t_end = lk0s[0][0], lk1s[-1][0]
        passes = len(lk0s)
        sub = first(DS, t_start, t_end, "submit_load")
        job = sub[2]
        fl = first(DS, t_start, t_end + 10**9, "flushed", job)
        fin = first(DS, t_start, t_end + 10**9, "finished", job)
        stepped = first(DS, t_start, t_end, "stepped", rid)
        slept = first(DS, stepped[0], t_end + 1, "slept", rid)
        hit_lk0 = lk0s[-1]
        cmd = first(DW, sub[0], t_end, "cmd", "LoadJob", job)
        fs = first(DW, cmd[0], t_end, "sent", "Fetch", rid)
        pdec = first(PW, cmd[0], t_end, "dec", "Fetch", rid)
        prx = last(PW, cmd[0], pdec[0] + 1, "rx")
        # send0: the frame is with the kernel from the send call on (the consumer may run, and preempt us, before it
        # returns: "sent" can come after the consumer saw everything)
        pos = first(PW, pdec[0], t_end + 10**9, "send0", "Offer", rid)
        ddec = first(DW, pdec[0], t_end, "dec", "Offer", rid)
        drx = last(DW, fs[0] if fs[0] < ddec[0] else cmd[0], ddec[0] + 1, "rx")
        c0 = first(DW, ddec[0], t_end, "copy0")
        c1 = first(DW, c0[0], t_end, "copy1")
        rr = first(DW, c1[0], t_end, "read_result")
        rel = first(DW, rr[0], t_end + 10**9, "sent", "Release", rid)
        ev = first(DW, rr[0], t_end + 10**9, "evt_put", "load", job)
        prel = first(PW, rel[0] - 10**7, t_end + 10**9, "dec", "Release", rid)
        pev = first(PW, prel[0], t_end + 10**9, "evt_put", "store", None)
        # producer scheduler for this rid
        sc = first(PS, 0, 10**20, "store_cmd", rid)
        ss = first(PS, sc[0], 10**20, "submit_store")
        sfl = first(PS, ss[0], 10**20, "flushed", ss[2])
        pcmd = first(PW, ss[0], 10**20, "cmd", "StoreJob", ss[2])
        pfin = first(PS, ss[0], 10**20, "finished", ss[2])

        add("D sched  first lookup pass (lk0->lk1, 64 lookups+promotions)", lk1s[0][0] - t_start)
        add("  D sched first pass: thread CPU time", cpu(lk1s[0]) - cpu(lk0s[0]))
        add("D sched  lk1 -> submit_load (step: flush promotions)", sub[0] - lk1s[0][0])
        add("D sched  submit_load -> flushed to cmd ring", fl[0] - sub[0])
        cnt("flush thread", fl[3])
        add("D worker ring put -> LoadJob taken (wake)", cmd[0] - fl[0])
        sb = sleep_before(DW, cmd[0])
        add("  D worker: asleep before LoadJob wake", sb[0] * 1000)
        cnt("D worker sleep timeout before LoadJob (us)", sb[1])
        add("D worker LoadJob taken -> Fetch sent (send returned)", fs[0] - cmd[0])
        s0 = first(DW, cmd[0], t_end, "S0", "load")
        s1 = first(DW, s0[0], t_end, "S1", "load")
        sd0 = first(DW, cmd[0], t_end, "send0", "Fetch", rid)
        add("  D worker: Session.load (64 keys) wall", s1[0] - s0[0])
        add("  D worker: Session.load CPU", cpu(s1) - cpu(s0))
        add("  D worker: send(Fetch) wall (lane or control link)", fs[0] - sd0[0])
        add("  D worker: send(Fetch) CPU", cpu(fs) - cpu(sd0))
        add("  D worker: LoadJob->Fetch sent CPU", cpu(fs) - cpu(cmd))
        add("D->P Fetch: D LoadJob taken -> P decoded Fetch", pdec[0] - cmd[0])
        sb = sleep_before(PW, prx[0])
        cnt("P worker sleep (asleep us, timeout us) before Fetch rx", (round(sb[0]), sb[1]))
        add("  P worker: asleep before Fetch wake", sb[0] * 1000)
        add("P worker Fetch decoded -> Offer handed to send", pos[0] - pdec[0])
        add("  P worker: Fetch decoded -> Offer handed to send CPU", cpu(pos) - cpu(pdec))
        add("P->D Offer: P Offer handed to send -> D decoded", ddec[0] - pos[0])
        add("P Fetch decoded -> D Offer decoded", ddec[0] - pdec[0])
        sb = sleep_before(DW, drx[0])
        cnt("D worker sleep (asleep us, timeout us, woke-before-rx us) before Offer rx",
            (round(sb[0]), sb[1], round(sb[2])))
        add("D worker Offer decoded -> copy start", c0[0] - ddec[0])
        add("D worker copy (the piece's memmoves)", c1[0] - c0[0])
        add("D worker copy end -> read_result", rr[0] - c1[0])
        add("  D worker: Offer decoded -> copy start CPU", cpu(c0) - cpu(ddec))
        r0 = first(DW, ddec[0], t_end, "S1", "receive")
        add("  D worker: Offer: rest of Session.receive after decode", r0[0] - ddec[0])
        b0 = first(DW, ddec[0], t_end, "rb0")
        b1 = first(DW, b0[0], t_end, "rb1")
        add("  D worker: read_blocks (queue pieces)", b1[0] - b0[0])
        add("  D worker: rb1 -> copy start", c0[0] - b1[0])
        add("D worker read_result -> JobFinished on evt ring", ev[0] - rr[0])
        o0 = first(DW, rr[0], t_end, "S0", "on_read_result")
        o1 = first(DW, o0[0], t_end, "S1", "on_read_result")
        add("  D worker: Session.on_read_result", o1[0] - o0[0])
        add("  D worker: Session.on_read_result CPU", cpu(o1) - cpu(o0))
        rs0 = first(DW, rr[0], t_end + 10**9, "send0", "Release", rid)
        add("  D worker: send(Release) wall", rel[0] - rs0[0])
        add("  D worker: read_result -> Release sent CPU", cpu(rel) - cpu(rr))
        add("D worker JobFinished on evt ring -> Release sent (sent after the event)", rel[0] - ev[0])
        add("D worker total LoadJob taken -> evt_put", ev[0] - cmd[0])
        add("  D worker total CPU", cpu(ev) - cpu(cmd))
        add("D sched  evt_put -> JobFinished seen (_finish)", fin[0] - ev[0])
        cnt("finish thread", fin[3])
        add("D sched  finished -> HIT pass end", t_end - fin[0])
        add("D sched  step end -> sleep 1ms returned (slept)", slept[0] - stepped[0])
        add("D sched  HIT pass (lk0->lk1, 64 lookups)", t_end - hit_lk0[0])
        add("TOTAL flushed -> finished seen", fin[0] - fl[0])
        add("TOTAL fetch (first lookup -> all HIT)", t_end - t_start)
        cnt("lookup passes", passes)
        add("P worker Release decoded after D sent it", prel[0] - rel[0])
        add("P worker Release decoded -> store JobFinished put", pev[0] - prel[0])
        add("P sched  store cmd -> submit_store", ss[0] - sc[0])
        add("P sched  submit_store -> flushed", sfl[0] - ss[0])
        cnt("P store flush thread", sfl[3])
        add("P worker StoreJob taken after flush", pcmd[0] - sfl[0])

n = len(H["TOTAL fetch (first lookup -> all HIT)"])
print(f"{n} warm requests; us")
print(f"  {'hop':72s} {'median':>8s} {'p90':>8s}")
for k, v in H.items():
    v = sorted(v)
    print(f"  {k:72s} {statistics.median(v):8.1f} {v[min(len(v) - 1, int(0.9 * len(v)))]:8.1f}")
for k, v in X.items():
    c = Counter(v)
    print(f"  {k}: {dict(c.most_common(8)) if len(c) < 12 else sorted(v)}")
