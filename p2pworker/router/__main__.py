"""`python -m p2pworker.router ...`: the router's command (p2pworker/router/cli.py)."""

from p2pworker.router.cli import router

if __name__ == "__main__":
    router(prog_name="python -m p2pworker.router")
