"""`kvlink proxy`: route each request to a prefill instance, then to a decode instance."""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

from kvlink.cli.ranges import ranged
from kvlink.layout.limits import PORT, SECONDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="prefill instance base URLs, e.g. http://127.0.0.1:8100")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="decode instance base URLs, e.g. http://127.0.0.1:8200")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=ranged(PORT), default=8000)
    parser.add_argument("--timeout-s", type=ranged(SECONDS), default=120.0,
                        help="deadline of each upstream call (and between streamed chunks)")
    parser.add_argument("--connect-timeout-s", type=ranged(SECONDS), default=5.0)
    parser.add_argument("--mode", choices=("classic", "layerwise"), default="classic",
                        help="classic: P prefills, then D loads with P's params; layerwise: P and D "
                             "get the request at once and P writes each layer into D's blocks as it "
                             "prefills (a request may also ask with kv_transfer_params.transfer_mode)")


def check_args(args: argparse.Namespace) -> None:
    for option, urls in (("--prefill", args.prefill), ("--decode", args.decode)):
        for url in urls:
            try:
                parts = urlsplit(url)
                port_ok = parts.port is None or parts.port > 0
            except ValueError:
                parts, port_ok = None, False
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
                raise ValueError(f"{option}: expected an http:// or https:// base URL with a host, "
                                 f"e.g. http://127.0.0.1:8100; got {url!r}")


def run(args: argparse.Namespace) -> int:
    import logging
    import sys

    from kvlink.serve.listen import ListenError, listen, serve
    from kvlink.serve.proxy import build_proxy_app
    from kvlink.serve.upstream import SERVER_KEEPALIVE_S

    try:
        sockets = listen(args.host, args.port)
    except ListenError as error:
        print(f"kvlink proxy: {error}", file=sys.stderr, flush=True)
        return 2

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # our own line per request says it all
    app = build_proxy_app(args.prefill, args.decode, timeout_s=args.timeout_s,
                          connect_timeout_s=args.connect_timeout_s, mode=args.mode)
    url = f"http://{args.host}:{args.port}"
    app.router.add_event_handler(
        "startup", lambda: print(f"kvlink proxy on {url}: prefill {' '.join(args.prefill)}, "
                                 f"decode {' '.join(args.decode)}", flush=True))
    serve(app, sockets, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
          timeout_keep_alive=SERVER_KEEPALIVE_S)
    return 0
