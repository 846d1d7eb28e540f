"""A stand-in for one `vllm serve` instance, run as its own process (so a test can kill it): OpenAI-style routes
that answer at once or stream, and record what they were sent.

    python tests/helpers/fakes/engine.py --port P --name N [--record FILE] [--tokens 5] [--token-delay 0.02]

POST /_fake/mode with JSON {"status": 500, "health": 503, "delay": 2.0} changes how it answers from then on.
Each request is recorded as one JSON line {"event": "request", "path", "headers", "body"}; a client that went away
before its answer ended as {"event": "disconnect", "path", "request_id"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--record", default="")
    ap.add_argument("--tokens", type=int, default=5)
    ap.add_argument("--token-delay", type=float, default=0.02)
    args = ap.parse_args()
    mode = {"status": 200, "health": 200, "delay": 0.0}
    record = open(args.record, "a", buffering=1) if args.record else None  # noqa: SIM115  one line per write

    def note(obj: dict) -> None:
        if record is not None:
            record.write(json.dumps(obj) + "\n")

    async def health(_r: web.Request) -> web.Response:
        return web.json_response({}, status=mode["health"])

    async def models(_r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "owned_by": args.name}]})

    async def set_mode(r: web.Request) -> web.Response:
        mode.update(await r.json())
        return web.json_response(mode)

    async def complete(r: web.Request) -> web.StreamResponse:
        body = await r.json()
        note({"event": "request", "path": r.path, "query": r.query_string, "headers": dict(r.headers), "body": body})
        try:
            if mode["delay"]:
                await asyncio.sleep(mode["delay"])
            if mode["status"] != 200:
                return web.json_response({"error": f"{args.name} told to fail"}, status=mode["status"])
            if not body.get("stream"):
                return web.json_response({"engine": args.name, "echo": body},
                                         headers={"X-Request-Id": r.headers.get("X-Request-Id", "")})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Engine": args.name})
            await resp.prepare(r)
            for i in range(args.tokens):
                await resp.write(b"data: %s\n\n" % json.dumps({"engine": args.name, "i": i}).encode())
                await asyncio.sleep(args.token_delay)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            note({"event": "disconnect", "path": r.path, "request_id": r.headers.get("X-Request-Id", "")})
            raise

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/_fake/mode", set_mode)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    web.run_app(app, host="127.0.0.1", port=args.port, handler_cancellation=True, access_log=None, print=None,
                shutdown_timeout=1)


if __name__ == "__main__":
    main()
