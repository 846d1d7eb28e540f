"""The router's command line: `p2pworker router ...`, or `python -m p2pworker.router ...` (the same command)."""

from __future__ import annotations

import click

from p2pworker.router.pool import Policy
from p2pworker.router.routing import Mode


@click.command("router", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default=Mode.PD.value, show_default=True,
              help="pd: prefill on a --prefill instance, then decode on a --decode instance.  aggregated: no "
                   "--prefill; each request goes to one --decode instance as it came (plus remote_kv_source when "
                   "it names a KV source).")
@click.option("--prefill", "prefill", multiple=True, metavar="URL[,worker=HOST:PORT]",
              help="A prefill engine (repeat for several; at least one in pd mode).  worker=: where its p2pworker "
                   "serves the KV (its tier's host and port + DP index); default: the URL's host, port 5710.")
@click.option("--decode", "decode", multiple=True, required=True, metavar="URL", help="A decode engine (repeat).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the router listens on.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--policy", type=click.Choice([p.value for p in Policy]), default=Policy.LEAST_IN_FLIGHT.value,
              show_default=True, help="How an instance is picked among those up.")
@click.option("--connect-timeout", type=float, default=5.0, show_default=True,
              help="Seconds to connect to an instance (then the next instance is tried).")
@click.option("--read-timeout", type=float, default=600.0, show_default=True,
              help="Longest silence from an instance, in seconds, before its call fails (a long prefill sends "
                   "nothing until it ends).")
@click.option("--health-interval", type=float, default=5.0, show_default=True,
              help="Seconds between health rounds (each instance's /health, each prefill worker's port); also the "
                   "longest delay between re-probes of an instance that is down.")
@click.option("--health-timeout", type=float, default=2.0, show_default=True)
@click.option("--max-body-mib", type=click.IntRange(min=0), default=256, show_default=True,
              help="Largest request body accepted (a prompt of 1M token ids is ~7 MiB of JSON); 0: no limit.")
@click.option("--shutdown-delay", type=float, default=0.0, show_default=True,
              help="On SIGTERM, seconds to go on serving while /health says 503 (draining), so that a load "
                   "balancer takes the router out first.")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Then seconds for requests in flight to finish before they are cut.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING"]), default="INFO", show_default=True,
              help="INFO includes one access-log line per request.")
def router(mode: str, prefill: tuple[str, ...], decode: tuple[str, ...], host: str, port: int, policy: str,
           connect_timeout: float, read_timeout: float, health_interval: float, health_timeout: float,
           max_body_mib: int, shutdown_delay: float, shutdown_timeout: float, log_level: str) -> None:
    """Router: OpenAI-compatible /v1/completions and /v1/chat/completions, /v1/models, /health, /metrics.

    PD mode: each request is prefilled on one PREFILL instance (max_tokens=1, remote_decoder), then answered by one
    DECODE instance (remote_prefiller -> that prefill instance's worker), streamed or not.  When no prefill serves
    it, decode recomputes (counted in p2pworker_router_recomputes_total, logged).  Honours llm-d's
    x-prefiller-host-port and x-kv-cache-source-host-port headers.  An instance that is down is re-probed (0.2 s,
    doubling up to --health-interval).
    """
    import logging

    from p2pworker.router.server import RouterConfig, serve

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = RouterConfig(prefill=prefill, decode=decode, mode=Mode(mode), host=host, port=port,
                           policy=Policy(policy), connect_timeout_s=connect_timeout, read_timeout_s=read_timeout,
                           health_interval_s=health_interval, health_timeout_s=health_timeout,
                           max_body_bytes=max_body_mib << 20, shutdown_delay_s=shutdown_delay,
                           shutdown_timeout_s=shutdown_timeout)
        serve(cfg)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from e
    except KeyboardInterrupt:
        pass
