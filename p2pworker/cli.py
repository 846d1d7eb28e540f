"""The ``p2pworker`` command line."""

from __future__ import annotations

import json
import os
import sys
import time

import click

from p2pworker import __version__
from p2pworker.router.cli import router as router_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="p2pworker")
def main() -> None:
    """p2pworker: a peer-to-peer KV-cache tier for vLLM, with an out-of-process transfer worker."""


@main.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), help="Worker TOML config.")
@click.option("--settings-json", default=None,
              help="Settings as JSON, the config file's shape ({\"worker\": {...}, \"control\": {...}}); applied "
                   "after --config, before the other flags.  The adapter passes the tier's worker_settings here.")
@click.option("--rings", required=True, help="Ring name prefix (the adapter created <PREFIX>.cmd and <PREFIX>.evt).")
@click.option("--name", default=None, help="Worker name (logs, admin path).")
@click.option("--host", default=None, help="Control host to bind (overrides [control] host).")
@click.option("--port", type=int, default=None, help="Control base port (0: any free port).")
@click.option("--advertise-host", default=None,
              help="Where peers reach this worker if not the bound host (a 0.0.0.0 bind advertises $POD_IP or this "
                   "machine's name resolved).")
@click.option("--dp-index", type=int, default=None, help="Data-parallel rank: bound port = port + index.")
@click.option("--backend", type=click.Choice(["auto", "nixl", "zmq"]), default=None, help="Data backend.")
@click.option("--admin", "admin_path", default=None, help="Admin socket path.")
@click.option("--metrics-port", type=int, default=None,
              help="Serve Prometheus metrics on this port + the DP index (0: off).")
@click.option("--metrics-host", default=None, help="Address the metrics endpoint binds (default 127.0.0.1).")
@click.option("--no-auth", is_flag=True, help="Disable control-plane authentication (logs a warning).")
@click.option("--wait-rings", "wait_rings_s", type=float, default=None,
              help="Wait up to this many seconds for the adapter to create the rings (operator-launched worker).")
@click.option("-v", "--verbose", count=True,
              help="-v: p2pworker's own DEBUG logs; -vv: every library's too.  Without it the level is "
                   "$P2PWORKER_LOG_LEVEL, else $VLLM_LOGGING_LEVEL (the engine that spawned us), else INFO.")
def launch(config_path, settings_json, rings, name, host, port, advertise_host, dp_index, backend, admin_path,
           metrics_port, metrics_host, no_auth, wait_rings_s, verbose) -> None:
    """Run a worker in the foreground (what the adapter spawns; an operator can run it by hand).

    The shared secret comes from $P2PWORKER_SECRET or the config's [control] secret.
    """
    from p2pworker.copytune import reexec_if_untuned

    reexec_if_untuned()  # copies that stream past the caches: a glibc tunable, read at process start only
    import logging

    from p2pworker.config import ConfigError, load_config
    from p2pworker.worker import Worker, install_hook

    root_level, own_level = log_levels(verbose, os.environ)
    logging.basicConfig(level=root_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("p2pworker").setLevel(own_level)
    over = _launch_overrides(rings, name=name, host=host, port=port, advertise_host=advertise_host,
                             dp_index=dp_index, backend=backend, admin_path=admin_path, metrics_port=metrics_port,
                             metrics_host=metrics_host, no_auth=no_auth, wait_rings_s=wait_rings_s)
    try:
        inline = None
        if settings_json is not None:
            try:
                inline = json.loads(settings_json)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--settings-json: not valid JSON: {e}") from None
        cfg = load_config(config_path, over, inline=inline, inline_source="--settings-json")
        worker = Worker(cfg)
        try:
            install_hook(worker)
        except BaseException:
            worker.stop_reason = "the $P2PWORKER_HOOK hook failed"
            worker.shutdown()  # rings, admin socket: nothing left behind
            raise
    except Exception as e:
        raise click.ClickException(f"worker did not start: {e}") from e
    worker.install_signal_handlers()
    sys.exit(worker.run())


def _launch_overrides(rings: str, *, name, host, port, advertise_host, dp_index, backend, admin_path, metrics_port,
                      metrics_host, no_auth, wait_rings_s) -> dict:
    """``launch``'s flags as settings, the config file's shape (applied last): only the flags given."""
    over: dict = {"rings": rings}
    control = {key: value for key, value in (("host", host), ("port", port), ("dp_index", dp_index),
                                             ("advertise_host", advertise_host)) if value is not None}
    if no_auth:
        control["auth"] = False
    if control:
        over["control"] = control
    if name:
        over["name"] = name
    if backend:
        over["data"] = {"backend": backend}
    if admin_path:
        over["admin_path"] = admin_path
    for key, value in (("metrics_port", metrics_port), ("metrics_host", metrics_host),
                       ("wait_rings_s", wait_rings_s)):
        if value is not None:
            over[key] = value
    return over


def log_levels(verbose: int, env) -> tuple[int, int]:
    """(root level, p2pworker's level) for ``-v`` count ``verbose``: 0 -> $P2PWORKER_LOG_LEVEL, else
    $VLLM_LOGGING_LEVEL, else INFO, for both; 1 -> p2pworker at DEBUG; 2+ -> everything at DEBUG."""
    import logging

    name = (env.get("P2PWORKER_LOG_LEVEL") or env.get("VLLM_LOGGING_LEVEL") or "INFO").upper()
    base = logging.getLevelName(name)
    if not isinstance(base, int):
        base = logging.INFO  # an unknown name: not worth failing a worker start over
    if verbose >= 2:
        return logging.DEBUG, logging.DEBUG
    return base, logging.DEBUG if verbose == 1 else base


def admin_paths(admin: str | None) -> list[str]:
    if admin:
        return [admin]
    import glob

    return sorted(glob.glob("/tmp/p2pworker-*.admin"))


def _table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells)


@main.command()
@click.option("--admin", default=None, help="Admin socket path (default: every /tmp/p2pworker-*.admin).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--timeout", "timeout_s", default=3.0, show_default=True)
def inspect(admin: str | None, as_json: bool, timeout_s: float) -> None:
    """Show workers: peers, session states, jobs in flight, bytes, errors, uptime.

    Exit status 0 when every worker found answered, 1 when one did not or none was found."""
    from p2pworker.admin import query

    out = []
    for path in admin_paths(admin):
        try:
            out.append({"admin": path, **query(path, timeout_s=timeout_s)})
        except (TimeoutError, OSError) as e:
            out.append({"admin": path, "error": str(e)})
    failed = [st for st in out if "error" in st]
    if as_json:
        click.echo(json.dumps(out, indent=2))
        if failed or not out:
            sys.exit(1)
        return
    if not out:
        click.echo("no workers found (no /tmp/p2pworker-*.admin)", err=True)
        sys.exit(1)
    for st in out:
        if "error" in st:
            click.echo(f"{st['admin']}: {st['error']}\n")
            continue
        _echo_worker(st)
        click.echo("")
    if failed:
        click.echo(f"{len(failed)} of {len(out)} worker(s) did not answer", err=True)
        sys.exit(1)


def _echo_worker(st: dict) -> None:
    """``inspect``'s text for one worker that answered."""
    click.echo(f"worker {st['name']} (pid {st['pid']})  {st['state']}  up {st['uptime_s']:.0f} s")
    click.echo(f"  control {st['address']}  data {st['backend']}  fingerprint {st['fingerprint']}")
    click.echo(f"  jobs in flight {st['jobs_in_flight']}  transfers in flight {st['transfers_in_flight']}  "
               f"bytes read {st['bytes_read']}  parked requests {st['parked_requests']}")
    click.echo(f"  errors {st['counters'].get('errors', 0)}  "
               f"protocol errors {st['counters'].get('protocol_errors', 0)}"
               f"  peer deaths {st['counters'].get('peer_deaths', 0)}")
    if not st["sessions"]:
        return
    rows = [[s["peer_id"] or "?", s["link"], s["state"], s["open_loads"], s.get("data_path") or "-",
             s.get("lane") or "-", s["close_reason"]] for s in st["sessions"]]
    click.echo("  " + _table(rows, ["peer", "link", "state", "loads", "data path", "messages via",
                                    "closed because"])
               .replace("\n", "\n  "))
    for s in st["sessions"]:  # why a link does not copy on this host: what an operator asks first
        if s.get("data_path_why"):
            click.echo(f"  {s['link']}: {s['data_path']}, not same_host: {s['data_path_why']}")
        pf = s.get("peer_region_prefault")
        if pf and pf["state"] != "done":  # copies out of pages not yet mapped here fault (slower, same bytes)
            click.echo(f"  {s['link']}: peer region pre-fault {pf['state']}, "
                       f"{pf['scanned_bytes'] >> 20} of {pf['nbytes'] >> 20} MiB walked"
                       + (f": {pf['error']}" if pf["error"] else ""))


@main.command()
@click.argument("address")
@click.option("--expect-fingerprint", default=None, help="Fingerprint digest this worker must match.")
@click.option("--timeout", "timeout_s", default=5.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def ping(address: str, expect_fingerprint: str | None, timeout_s: float, as_json: bool) -> None:
    """Handshake with the worker at ADDRESS (host:port): round-trip time and fingerprint.

    Uses the shared secret from $P2PWORKER_SECRET; a wrong secret is reported
    as an authentication failure.  Exit status 1 when unreachable, rejected or
    (with --expect-fingerprint) incompatible.
    """
    from p2pworker.control import ControlConfig, ZmqControl
    from p2pworker.errors import P2PError

    try:
        ctl = ZmqControl(ControlConfig(port=0, heartbeat_interval_s=timeout_s / 3))
    except P2PError as e:
        raise click.ClickException(str(e)) from e
    try:
        info, up_s, probe_s = _probe(ctl, address, timeout_s)
    except P2PError as e:
        raise click.ClickException(f"{address}: {e}") from e
    finally:
        ctl.close()
    compatible = None if expect_fingerprint is None else info.fingerprint.digest == expect_fingerprint
    out = {"address": address, "node_id": info.peer_id, "protocol_version": info.version,
           "handshake_ms": round(up_s * 1000, 3), "rtt_ms": round(probe_s * 1000, 3),
           "fingerprint": info.fingerprint.digest, "fingerprint_fields": info.fingerprint.fields,
           "backend": info.backend, "num_blocks": info.num_blocks, "block_bytes": info.block_bytes,
           "compatible": compatible}
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo(f"pong from {info.peer_id} at {address}: authenticated handshake {out['handshake_ms']} ms, "
                   f"round trip {out['rtt_ms']} ms")
        click.echo(f"  protocol v{info.version}, data backend {info.backend}, "
                   f"region {info.num_blocks} x {info.block_bytes} B")
        click.echo(f"  fingerprint {info.fingerprint.digest}: {info.fingerprint.fields}")
        if compatible is not None:
            click.echo(f"  compatible with {expect_fingerprint}: {'yes' if compatible else 'NO'}")
    if compatible is False:
        sys.exit(1)


def _probe(ctl, address: str, timeout_s: float):
    """Dial ``address`` and probe it: (its ProbeInfo, seconds to the authenticated link, the probe's round trip);
    ClickException when the link goes down or nothing answers within ``timeout_s``."""
    from p2pworker.control import LinkDown, LinkUp, Received
    from p2pworker.protocol import messages as m

    t0 = time.perf_counter()
    link = ctl.connect(address)
    info = up_s = probe_s = None
    deadline = time.monotonic() + timeout_s
    while info is None and time.monotonic() < deadline:
        for ev in ctl.poll(10):
            if isinstance(ev, LinkDown):
                raise click.ClickException(f"{address}: {ev.reason}")
            if isinstance(ev, LinkUp):
                up_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                ctl.send(link, m.encode(m.Probe(m.PROTOCOL_VERSION)))
            if isinstance(ev, Received):
                msg = m.decode(ev.payload)
                if isinstance(msg, m.ProbeInfo):
                    probe_s = time.perf_counter() - t1
                    info = msg
    if info is None:
        raise click.ClickException(f"{address}: no answer within {timeout_s} s")
    return info, up_s, probe_s


def worker_fingerprint(address: str, timeout_s: float = 5.0) -> tuple[str, dict]:
    """The fingerprint (digest, fields) the worker at ``address`` answers a probe with ($P2PWORKER_SECRET)."""
    from p2pworker.control import ControlConfig, ZmqControl

    ctl = ZmqControl(ControlConfig(port=0, heartbeat_interval_s=timeout_s / 3))
    try:
        info, _, _ = _probe(ctl, address, timeout_s)
    finally:
        ctl.close()
    return info.fingerprint.digest, dict(info.fingerprint.fields)


@main.command()
@click.option("--source", "source_url", required=True, help="The engine that holds the prefixes (http://HOST:PORT).")
@click.option("--puller", "puller_url", required=True, help="The engine that pulls them (http://HOST:PORT).")
@click.option("--source-p2p", default=None,
              help="The source's worker, HOST:PORT (the tier's host and port); default: what the source publishes "
                   "(vLLM 0.33's vllm:kv_offload_config_info).")
@click.option("--puller-p2p", default=None,
              help="The puller's worker, HOST:PORT: with it the two workers' fingerprints are compared first.")
@click.option("--lengths", default="", help="Prompt lengths in tokens, comma-separated (rounded up to the block "
                                            "size); default: 2048,4096,...,32768 up to the engines' limit.")
@click.option("--reps", default=5, show_default=True, type=click.IntRange(1, 100), help="Reps per length.")
@click.option("--settle", "settle_s", default=2.0, show_default=True, type=click.FloatRange(0, 60),
              help="Seconds after seeding the source before the puller's request (the source stores a step later).")
@click.option("--timeout", "timeout_s", default=60.0, show_default=True, type=click.FloatRange(1, 600),
              help="Bound of every HTTP call and handshake.")
@click.option("--token-range", default="100:1000", show_default=True,
              help="Random prompt token ids in [LOW, HIGH): inside the model's vocabulary.")
@click.option("--seed", type=int, default=None, help="Seed of the random prompts (default: fresh each run).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Also write the result (every sample, the fits) as JSON here.")
def calibrate(source_url, puller_url, source_p2p, puller_p2p, lengths, reps, settle_s, timeout_s, token_range,
              seed, json_path) -> None:
    """Time to first token with the prefix pulled from a peer vs recomputed, on two live engines, and the
    minCachedTokenDelta it gives llm-d's p2p-source-producer: the shortest tested length from which the pull wins.

    Both engines must run the P2PWorkerTier with the same model and fingerprint; the puller must serve nothing
    else meanwhile.  Exit status 1, with the reason, when an engine is unreachable or lacks the tier, the
    fingerprints differ, a recompute leg hit a cache (contaminated), a pull leg did not pull, or the pull never
    keeps winning (no crossover).
    """
    from p2pworker import calibrate as cal

    try:
        low, high = (int(x) for x in token_range.split(":"))
        asked = tuple(int(x) for x in lengths.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter("--lengths N,N,...  --token-range LOW:HIGH") from None
    settings = cal.Settings(lengths=asked, reps=reps, settle_s=settle_s, timeout_s=timeout_s, token_low=low,
                            token_high=high, seed=seed)
    run = cal.Calibration(cal.Http(source_url, timeout_s), cal.Http(puller_url, timeout_s), settings,
                          source_p2p=source_p2p, puller_p2p=puller_p2p)
    try:
        result = _calibrate(run, timeout_s)
    except cal.Refused as e:
        click.echo(f"calibrate: refused ({e.why.value}): {e}", err=True)
        sys.exit(1)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result.to_json(), f, indent=1)
    click.echo(cal.table(result))
    if result.crossover is None:
        click.echo(f"calibrate: NO CROSSOVER: recompute wins at {result.points[-1].length} tokens, the longest "
                   "tested: pulls do not pay off in this range (extend --lengths if the engines take longer "
                   "prompts)", err=True)
        sys.exit(1)
    click.echo(cal.recommendation(result))


def _calibrate(run, timeout_s: float):
    """``calibrate``'s refusals, then its measurement under a progress bar on stderr."""
    from p2pworker import calibrate as cal
    from p2pworker.errors import P2PError

    def fingerprint_of(address: str) -> tuple[str, dict]:
        try:
            return worker_fingerprint(address, timeout_s)
        except (P2PError, click.ClickException) as e:
            msg = e.format_message() if isinstance(e, click.ClickException) else str(e)
            raise cal.Refused(cal.Refusal.UNREACHABLE, f"worker {address} did not answer a handshake ({msg}); "
                              "is $P2PWORKER_SECRET the engines' secret?") from None

    run.preflight(fingerprint_of)
    with click.progressbar(length=run.total_steps(), label="calibrating", show_pos=True, file=sys.stderr) as bar:
        return run.run(progress=bar.update)


main.add_command(router_command)


@main.command("bench-ring")
@click.option("-n", "--round-trips", default=20000, show_default=True, help="Round trips per contender.")
@click.option("--warmup", default=2000, show_default=True)
@click.option("--wake-n", default=500, show_default=True, help="Round trips of the wake-from-sleep contender.")
def bench_ring(round_trips: int, warmup: int, wake_n: int) -> None:
    """Ring round trip (adapter -> worker -> adapter) vs multiprocessing.Queue and ZMQ ipc.

    Prints one JSON line per contender: p50_us, p99_us, mean_us.
    """
    from p2pworker.bench.ring_latency import run

    for row in run(round_trips, warmup, wake_n):
        click.echo(json.dumps(row))


@main.command()
@click.option("--requests", default=32, show_default=True, help="PD requests to move.")
@click.option("--blocks", default=64, show_default=True, help="KV blocks per request.")
@click.option("--block-kib", default=256, show_default=True, help="Bytes per block, KiB.")
@click.option("--inflight", default=4, show_default=True, help="Requests in flight at once.")
@click.option("--backend", type=click.Choice(["auto", "nixl", "zmq"]), default="auto", show_default=True)
def demo(requests: int, blocks: int, block_kib: int, inflight: int, backend: str) -> None:
    """The main job, no vLLM needed: PD transfers between two workers on loopback, every byte verified.

    Creates two KV regions in /dev/shm, launches a "prefill" and a "decode"
    worker, parks each request's blocks on prefill (StoreJob) and has decode
    fetch them into rows it grants (LoadJob), checks every byte, prints
    throughput and latency, and cleans everything up.  Exits non-zero on any
    failure or mismatch.
    """
    import tempfile

    from p2pworker.bench.pd import PDRig

    bb = block_kib * 1024
    num_blocks = blocks * inflight * 2
    total = requests * blocks * bb
    log = tempfile.NamedTemporaryFile(prefix="p2pworker-demo-", suffix=".log", delete=False)
    click.echo(f"p2pworker demo: {requests} requests x {blocks} blocks x {block_kib} KiB = {total / 2**20:.0f} MiB "
               f"prefill -> decode, {inflight} in flight (worker logs: {log.name})")
    t0 = time.perf_counter()
    with PDRig(num_blocks, bb, backend=backend, stderr=log) as rig:
        click.echo(f"two workers up in {time.perf_counter() - t0:.1f} s; data backend: {rig.backend}; "
                   f"regions {num_blocks} x {block_kib} KiB in /dev/shm")
        with click.progressbar(length=requests, label="transferring", show_pos=True) as bar:
            res = rig.run(requests, blocks, inflight=inflight, progress=bar.update)
        codes = rig.close()
    click.echo(f"moved {res.bytes_moved / 2**20:.0f} MiB in {res.seconds:.2f} s: {res.gbps:.2f} GB/s "
               f"(every byte compared inside the timed loop; `p2pworker bench` times transfers alone)")
    click.echo(f"per request ({blocks * bb / 2**20:.0f} MiB, submit to loaded): "
               f"p50 {res.latency_ms(0.5):.1f} ms, p99 {res.latency_ms(0.99):.1f} ms")
    verified = requests - len(res.failures) - res.mismatches
    click.echo(f"verified byte-exact: {verified}/{requests} requests; mismatches {res.mismatches}; "
               f"failures {len(res.failures)}; worker exit codes {codes}")
    for f in res.failures[:5]:
        click.echo(f"  failure: {f}", err=True)
    if res.failures or res.mismatches or codes != [0, 0]:
        click.echo("demo FAILED", err=True)
        sys.exit(1)
    os.unlink(log.name)
    click.echo("demo OK; nothing left in /dev/shm")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON line per geometry and data path.")
@click.option("--block-kib", "block_kibs", multiple=True, type=int, default=(16, 256), show_default=True)
@click.option("--blocks", "block_counts", multiple=True, type=int, default=(64, 512), show_default=True)
@click.option("--requests", default=24, show_default=True, help="Requests per geometry (throughput run).")
@click.option("--inflight", default=4, show_default=True)
@click.option("--path", "paths", multiple=True, type=click.Choice(["nixl", "same_host"]),
              default=("nixl", "same_host"), show_default=True, help="Data paths to run the workers on.")
@click.option("--save", "save_path", default=None, type=click.Path(dir_okay=False),
              help="Also write the rows as a results file (the benchmarks' format, p2pworker/bench/results.py): "
                   "benchmarks/results/bench.json in a checkout.")
def bench(as_json: bool, block_kibs: tuple[int, ...], block_counts: tuple[int, ...], requests: int,
          inflight: int, paths: tuple[str, ...], save_path: str | None) -> None:
    """Throughput and latency through two workers vs raw NIXL and memcpy in the same run.

    ``workers_gbps``: PD requests (contiguous rows) through both workers'
    rings, sessions and data planes, ``inflight`` at a time, on each data path
    (``nixl``: NIXL even on one host, ``[data] same_host = false``;
    ``same_host``: the consumer's worker copies out of the producer's region
    file); ``raw_nixl_gbps``: one process reading the same geometry from
    another with bare NIXL calls; ``memcpy_gbps``: one numpy copy of the rows
    between two regions in one process; ``ratio`` = workers / raw NIXL,
    ``vs_memcpy`` = workers / memcpy; ``latency_ms_p50``: one request alone,
    submit to loaded.  (The demo verifies bytes; bench does not.)
    """
    import tempfile

    from p2pworker.admin import query
    from p2pworker.bench import results
    from p2pworker.bench.data_throughput import bench_geometry
    from p2pworker.bench.pd import PDRig

    saving = results.Run("bench") if save_path else None
    rows = []
    log = tempfile.NamedTemporaryFile(prefix="p2pworker-bench-", suffix=".log", delete=False)
    t_start = time.perf_counter()

    def progress(what: str) -> None:  # minutes of work: say what runs (stderr; --json output stays clean)
        click.echo(f"bench [{time.perf_counter() - t_start:6.1f} s] {what}", err=True)

    for kib in block_kibs:
        bb = kib * 1024
        progress(f"{kib} KiB blocks: raw NIXL and memcpy, {', '.join(map(str, block_counts))} blocks per request")
        base: dict[tuple[str, int], float] = {
            (r["contender"], r["blocks"]): r["gbps_median"]
            for r in bench_geometry(bb, list(block_counts), reps=7, batch_bytes=32 << 20,
                                    only={"raw_nixl", "memcpy"}, patterns=("contig",))}
        for path in paths:
            args = [] if path == "same_host" else ["--settings-json", json.dumps({"data": {"same_host": False}})]
            with PDRig(max(block_counts) * inflight * 2, bb, backend="nixl", stderr=log, worker_args=args) as rig:
                for n in block_counts:
                    progress(f"{kib} KiB x {n}: {requests} requests through two workers ({path}), {inflight} in flight")
                    rig.run(2, n, inflight=1, verify=False, contiguous=True)  # warm-up: sessions, connections
                    sessions = query(rig.decode.ready.admin)["sessions"]
                    used = {x["data_path"] for x in sessions if x["data_path"]}
                    if used != {path}:
                        raise click.ClickException(f"the workers were to use {path} but use {sorted(used)}")
                    lane = ",".join(sorted({x["lane"] for x in sessions}))  # same_host: its messages on a lane
                    thr = rig.run(requests, n, inflight=inflight, verify=False, contiguous=True)
                    lat = rig.run(max(5, requests // 3), n, inflight=1, verify=False, contiguous=True)
                    if thr.failures or thr.mismatches or lat.failures:
                        raise click.ClickException(f"bench run failed: {(thr.failures + lat.failures)[:3]}")
                    raw, mem = base[("raw_nixl", n)], base[("memcpy", n)]
                    row = {"block_bytes": bb, "blocks": n, "request_bytes": n * bb, "data_path": path, "messages": lane,
                           "workers_gbps": round(thr.gbps, 3), "raw_nixl_gbps": raw, "memcpy_gbps": mem,
                           "ratio": round(thr.gbps / raw, 3), "vs_memcpy": round(thr.gbps / mem, 3),
                           "latency_ms_p50": round(lat.latency_ms(0.5), 3),
                           "latency_ms_p99": round(lat.latency_ms(0.99), 3)}
                    rows.append(row)
                    if as_json:
                        click.echo(json.dumps(row), nl=True)
    os.unlink(log.name)
    if saving is not None:
        click.echo(f"results: {saving.save(save_path, {'requests': requests, 'inflight': inflight, 'rows': rows})}",
                   err=True)
    if not as_json:
        click.echo(_table([[r["block_bytes"] // 1024, r["blocks"], r["data_path"], r["workers_gbps"],
                            r["raw_nixl_gbps"], r["memcpy_gbps"], r["ratio"], r["vs_memcpy"], r["latency_ms_p50"],
                            r["latency_ms_p99"]] for r in rows],
                          ["block KiB", "blocks", "path", "workers GB/s", "raw NIXL GB/s", "memcpy GB/s",
                           "vs raw", "vs memcpy", "lat p50 ms", "lat p99 ms"]))


@main.group()
def config() -> None:
    """Worker configuration files."""


@config.command("check")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
def config_check(path: str) -> None:
    """Print the effective settings of PATH (defaults filled in, secret masked) as JSON, or the error (naming
    the file and the key's path, e.g. $.control.port) with exit status 1.

    PATH is a worker TOML, or a vLLM JSON (a --kv-transfer-config, its kv_connector_extra_config, or one
    secondary tier's entry): then each P2PWorkerTier entry's keys are checked and the worker settings they give
    (worker_config, then worker_settings) are printed, as the tier would start its worker."""
    import msgspec

    from p2pworker.config import ConfigError, effective, load_config, tier_entries, tier_settings

    try:
        if path.endswith(".json"):
            try:
                with open(path) as f:
                    doc = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON: {e}") from None
            entries = tier_entries(doc)
            if not entries:
                raise ConfigError(f"{path}: no secondary tier of type P2PWorkerTier in it")
            out = []
            for entry in entries:
                s, cfg = tier_settings(entry)
                out.append({"tier": {k: v for k, v in msgspec.to_builtins(s).items() if k != "worker_settings"},
                            "worker": effective(cfg)})
            click.echo(json.dumps(out if len(out) > 1 else out[0], indent=2))
            return
        cfg = load_config(path)
    except ConfigError as e:
        click.echo(f"error: {path}: {e}" if not str(e).startswith(path) else f"error: {e}", err=True)
        sys.exit(1)
    click.echo(json.dumps(effective(cfg), indent=2))


@main.command("sweep")
@click.argument("prefix")
@click.option("--dry-run", is_flag=True, help="List what would be removed.")
def sweep_cmd(prefix: str, dry_run: bool) -> None:
    """Remove /dev/shm entries starting with PREFIX left by a crashed process (e.g. p2pw_vllm-<engine id>)."""
    from p2pworker.shm.sweep import leftovers, sweep

    if not prefix:
        raise click.BadParameter("an empty prefix would match every file in /dev/shm", param_hint="PREFIX")
    paths = leftovers(prefix) if dry_run else sweep(prefix)
    for p in paths:
        click.echo(p)
    click.echo(f"{len(paths)} entr{'y' if len(paths) == 1 else 'ies'} {'found' if dry_run else 'removed'}", err=True)


if __name__ == "__main__":  # pragma: no cover
    main()
