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
