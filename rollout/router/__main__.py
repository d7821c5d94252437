"""`python -m rollout.router`: an HTTP router over several sidecars' HTTP fronts (`rollout.serve
--http-port P` each). Point an agent environment's OpenAI base URL at it; every call of a session (an
episode: its `X-Session-ID` header, body `session_id`, SGLang's `session_params.id` or OpenAI's `user`)
goes to the sidecar that holds the episode so far in its prefix cache, new sessions to the least busy
sidecar. Prints `READY <url>` once it serves.

    python -m rollout.router --sidecars http://10.0.0.1:8000 http://10.0.0.2:8000 --port 9000 --token T
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time

import uvicorn

from rollout.router.app import build_app

log = logging.getLogger("rollout.router")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rollout.router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sidecars", nargs="+", required=True, metavar="URL",
                   help="each sidecar's HTTP front, e.g. http://host:8000 (its --http-port)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (anything but loopback needs --token, as "
                   "the sidecars do)")
    p.add_argument("--port", type=int, default=0, help="port to serve on (0: a free one, printed in READY)")
    p.add_argument("--token", default=os.environ.get("ROLLOUT_TOKEN", ""),
                   help="the sidecars' bearer token: callers must send it, and it goes on to the sidecar "
                   "(default: $ROLLOUT_TOKEN)")
    p.add_argument("--margin", type=int, default=16, help="a session moves when its sidecar has more than this "
                   "many calls in flight beyond the least busy one's, and twice its calls")
    p.add_argument("--idle-s", type=float, default=600.0, help="a session with no call for this long is "
                   "forgotten (its next call is placed anew); /finish_session ends one at once")
    p.add_argument("--poll-s", type=float, default=0.5, help="how often each sidecar's GET /load is asked")
    p.add_argument("--poll-timeout-s", type=float, default=5.0, help="how long a GET /load may take to answer")
    p.add_argument("--misses", type=int, default=3, help="polls timed out in a row before a sidecar counts as gone "
                   "(its sessions move); a refused connection counts at once")
    p.add_argument("--paused-s", type=float, default=60.0, help="a sidecar pushing weights for longer than "
                   "this takes no calls until the push ends")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="request bodies larger than this get 413 (the "
                   "sidecars' own limit, --http-max-body-mb, is 8 too)")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process does (launchers set it)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.misses < 1 or args.poll_timeout_s <= 0:
        p.error(f"--misses must be >= 1 and --poll-timeout-s > 0, got {args.misses} and {args.poll_timeout_s}")
    if not args.token and args.host not in ("127.0.0.1", "localhost", "::1"):
        p.error(f"--host {args.host} reaches beyond this machine: set --token (the sidecars', as they require)")
    return args


class _Server(uvicorn.Server):
    async def startup(self, sockets=None):
        await super().startup(sockets)
        port = self.servers[0].sockets[0].getsockname()[1]
        print(f"READY http://{self.config.host}:{port}", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per relayed call and poll otherwise
    app = build_app(args.sidecars, args.token, args.margin, args.idle_s, args.poll_s, args.paused_s,
                    int(args.max_body_mb * (1 << 20)), args.poll_timeout_s, args.misses)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                            timeout_keep_alive=30)
    server = _Server(config)
    if args.parent_pid:
        threading.Thread(target=_exit_with, args=(args.parent_pid, server), daemon=True).start()
    asyncio.run(server.serve())


def _exit_with(pid: int, server: uvicorn.Server) -> None:
    """The router stops once its parent is gone (a killed test, a trainer that died)."""
    while True:
        time.sleep(0.5)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("parent process %d is gone: stopping", pid)
            server.should_exit = True
            return


if __name__ == "__main__":
    main()
