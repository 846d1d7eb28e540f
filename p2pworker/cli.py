"""The ``p2pworker`` command line."""

from __future__ import annotations

import json
import sys

import click

from p2pworker import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="p2pworker")
def main() -> None:
    """p2pworker: a peer-to-peer KV-cache tier for vLLM, with an out-of-process transfer worker."""


@main.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), help="Worker TOML config.")
@click.option("--rings", required=True, help="Ring name prefix (the adapter created <PREFIX>.cmd and <PREFIX>.evt).")
@click.option("--name", default=None, help="Worker name (logs, admin path).")
@click.option("--host", default=None, help="Control host to bind (overrides [control] host).")
@click.option("--port", type=int, default=None, help="Control base port (0: any free port).")
@click.option("--dp-index", type=int, default=None, help="Data-parallel rank: bound port = port + index.")
@click.option("--backend", type=click.Choice(["auto", "nixl", "zmq"]), default=None, help="Data backend.")
@click.option("--admin", "admin_path", default=None, help="Admin socket path.")
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics on this port.")
@click.option("--no-auth", is_flag=True, help="Disable control-plane authentication (logs a warning).")
@click.option("-v", "--verbose", count=True)
def launch(config_path, rings, name, host, port, dp_index, backend, admin_path, metrics_port, no_auth, verbose) -> None:
    """Run a worker in the foreground (what the adapter spawns; an operator can run it by hand).

    The shared secret comes from $P2PWORKER_SECRET or the config's [control] secret.
    """
    import logging

    from p2pworker.config import load_config
    from p2pworker.worker import Worker

    logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    over: dict = {"rings": rings}
    control: dict = {}
    for key, value in (("host", host), ("port", port), ("dp_index", dp_index)):
        if value is not None:
            control[key] = value
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
    if metrics_port is not None:
        over["metrics_port"] = metrics_port
    try:
        cfg = load_config(config_path, over)
        worker = Worker(cfg)
    except Exception as e:
        raise click.ClickException(f"worker did not start: {e}") from e
    worker.install_signal_handlers()
    sys.exit(worker.run())


def _admin_paths(admin: str | None) -> list[str]:
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
    """Show workers: peers, session states, jobs in flight, bytes, errors, uptime."""
    from p2pworker.admin import query

    out = []
    for path in _admin_paths(admin):
        try:
            out.append({"admin": path, **query(path, timeout_s=timeout_s)})
        except (TimeoutError, OSError) as e:
            out.append({"admin": path, "error": str(e)})
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    if not out:
        click.echo("no workers found (no /tmp/p2pworker-*.admin)")
        return
    for st in out:
        if "error" in st:
            click.echo(f"{st['admin']}: {st['error']}\n")
            continue
        click.echo(f"worker {st['name']} (pid {st['pid']})  {st['state']}  up {st['uptime_s']:.0f} s")
        click.echo(f"  control {st['address']}  data {st['backend']}  fingerprint {st['fingerprint']}")
        click.echo(f"  jobs in flight {st['jobs_in_flight']}  transfers in flight {st['transfers_in_flight']}  "
                   f"bytes written {st['bytes_written']}  parked requests {st['parked_requests']}")
        click.echo(f"  errors {st['counters'].get('errors', 0)}  protocol errors {st['counters'].get('protocol_errors', 0)}"
                   f"  peer deaths {st['counters'].get('peer_deaths', 0)}")
        if st["sessions"]:
            rows = [[s["peer_id"] or "?", s["link"], s["state"], s["open_loads"], s["close_reason"]] for s in st["sessions"]]
            click.echo("  " + _table(rows, ["peer", "link", "state", "loads", "closed because"]).replace("\n", "\n  "))
        click.echo("")


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
@click.option("-n", "--round-trips", default=20000, show_default=True)
def demo(round_trips: int) -> None:
    """The main job.  For now: the shared-memory plane between two processes.

    Runs the ring latency benchmark against multiprocessing.Queue and ZMQ ipc,
    side by side.  The PD transfer demo between two workers replaces this once
    the worker lands.
    """
    from p2pworker.bench.ring_latency import run

    click.echo("p2pworker demo: command/event rings between two processes (adapter <-> worker)")
    rows = run(round_trips, 2000, 500)
    for row in rows:
        click.echo(json.dumps(row))
    by = {r["contender"]: r for r in rows}
    ring, zmq_ = by["p2pworker_ring"], by["zmq_ipc_pair"]
    click.echo(
        f"ring round trip p50 {ring['p50_us']} us / p99 {ring['p99_us']} us; "
        f"{zmq_['p50_us'] / ring['p50_us']:.1f}x faster than ZMQ ipc at p50 in this run"
    )
    if ring["p50_us"] >= zmq_["p50_us"]:
        click.echo("ring slower than ZMQ ipc in this run: the machine is overloaded?", err=True)
        sys.exit(1)


@main.command("sweep")
@click.argument("prefix")
@click.option("--dry-run", is_flag=True, help="List what would be removed.")
def sweep_cmd(prefix: str, dry_run: bool) -> None:
    """Remove /dev/shm entries starting with PREFIX left by a crashed process."""
    from p2pworker.shm.sweep import leftovers, sweep

    paths = leftovers(prefix) if dry_run else sweep(prefix)
    for p in paths:
        click.echo(p)
    click.echo(f"{len(paths)} entr{'y' if len(paths) == 1 else 'ies'} {'found' if dry_run else 'removed'}", err=True)


if __name__ == "__main__":  # pragma: no cover
    main()
