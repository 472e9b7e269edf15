"""Keep a model's routing rendered: a webhook receiver that re-renders it whenever the registry says a channel
changed (a split's weights, a promotion, a yanked canary), and optionally applies it.

    KILN_WEBHOOK_SECRET=... KILN_TOKEN=<a read token> python examples/routing-webhook/consumer.py \\
        --registry https://registry.example.com --listen 0.0.0.0:8080 --model 'llama-*' --channel prod \\
        --format gateway-api --pool h100:8 --pool mi300x:8 --out-dir deploy/routing [--apply]

Each delivery is checked as the registry signs it (registry/webhooks/delivery.py): `X-Kiln-Signature` is
`sha256=` and the hex HMAC-SHA256 of `<X-Kiln-Timestamp>.<raw body>` keyed with the webhook's secret, and the
timestamp is recent; anything else is answered 401 before the body is parsed. A delivery is answered 202 as
soon as it is queued: the render runs in a worker thread (the registry waits at most its webhook timeout),
reads the channel as it is then (so events that arrive together make one render, and a late duplicate
changes nothing), and writes `<out-dir>/<model>-<channel>-<format>.yaml` through a temporary file. With
`--apply`, `kubectl apply -f` follows each write. With `--model` naming one model (no wildcard), its
channels are rendered once at start as well.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import hmac
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kiln.client import RegistryClient
from kiln.core.errors import KilnError
from kiln.routing import RenderOptions, Sizing, render_channel, write_atomically

LOG = logging.getLogger("routing-webhook")
TOLERANCE_S = 300  # a signed request older (or newer) than this is refused: a replay
MAX_BODY = 1 << 20  # the registry's events are a few KiB
CHANNEL_EVENTS = {"channel.split", "channel.promote", "channel.promote.forced"}
RELEASE_EVENTS = {"release.yank"}  # a yanked canary leaves every split of its model
RETRIES = 3


def verify(secret: str, timestamp: str | None, signature: str | None, body: bytes, now: float) -> bool:
    """The registry's signature over `<timestamp>.<body>`, compared in constant time, on a recent timestamp."""
    if timestamp is None or signature is None or not timestamp.isascii() or not timestamp.isdigit():
        return False
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    fresh = abs(now - int(timestamp)) <= TOLERANCE_S
    return hmac.compare_digest("sha256=" + mac.hexdigest(), signature) and fresh


class Renderer:
    """Renders (model, channel) pairs in a thread of its own; a pair asked for again while it waits is one render."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sizing = Sizing.of(
            context=args.context, concurrency=args.concurrency, policy=args.policy, kv_cache_dtype=args.kv_cache_dtype
        )
        self.options = RenderOptions(namespace=args.namespace, priority=args.priority, oci_host=args.oci_host)
        self._pending: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._wake = threading.Condition()
        threading.Thread(target=self._run, name="render", daemon=True).start()

    def ask(self, model: str, channel: str) -> None:
        with self._wake:
            self._pending[(model, channel)] = None
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending:
                    self._wake.wait()
                (model, channel), _ = self._pending.popitem(last=False)
            for attempt in range(1, RETRIES + 1):
                try:
                    self.render(model, channel)
                    break
                except (KilnError, OSError, subprocess.SubprocessError) as exc:
                    LOG.error("render of %s/%s failed (attempt %d of %d): %s", model, channel, attempt, RETRIES, exc)
                    time.sleep(2**attempt)

    def render(self, model: str, channel: str) -> None:
        with RegistryClient.connect(self.args.registry) as client:
            for fmt in self.args.format:
                rendered = render_channel(client, model, channel, fmt, self.args.pool, self.sizing, self.options)
                path = self.args.out_dir / f"{model}-{channel}-{fmt}.yaml"
                if path.exists() and path.read_text() == rendered.text:
                    LOG.info("%s/%s %s: unchanged", model, channel, fmt)
                    continue
                write_atomically(path, rendered.text)
                split = ", ".join(f"{v} {w / 100:g} %" for v, w in rendered.routing.split)
                LOG.info("%s/%s %s: wrote %s (%s)", model, channel, fmt, path, split)
                if self.args.apply:
                    subprocess.run([self.args.kubectl, "apply", "-f", str(path)], check=True, timeout=300)
                    LOG.info("%s/%s %s: applied", model, channel, fmt)


class Receiver(BaseHTTPRequestHandler):
    """POSTs from the registry: checked, then queued for the renderer."""

    server: Server

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY:
            self._answer(413 if length else 411)
            return
        body = self.rfile.read(length)
        signed = verify(
            self.server.secret,
            self.headers.get("X-Kiln-Timestamp"),
            self.headers.get("X-Kiln-Signature"),
            body,
            time.time(),
        )
        if not signed:
            LOG.warning("refused a delivery with a bad or stale signature from %s", self.client_address[0])
            self._answer(401)
            return
        try:
            event = json.loads(body)
        except ValueError:
            self._answer(400)
            return
        self._answer(202)
        if isinstance(event, dict):
            self.server.handle_event(event)

    def _answer(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        LOG.debug(format, *args)


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], secret: str, args: argparse.Namespace) -> None:
        super().__init__(address, Receiver)
        self.secret = secret
        self.args = args
        self.renderer = Renderer(args)
        self._seen: OrderedDict[int, None] = OrderedDict()  # delivery is at least once: ids already handled
        self._lock = threading.Lock()

    def handle_event(self, event: dict[str, Any]) -> None:
        event_id = event.get("id")
        with self._lock:
            if not isinstance(event_id, int) or event_id in self._seen:
                return
            self._seen[event_id] = None
            while len(self._seen) > 10_000:
                self._seen.popitem(last=False)
        name, model = event.get("event"), event.get("model")
        if not isinstance(model, str) or not fnmatch.fnmatchcase(model, self.args.model):
            return
        if name in CHANNEL_EVENTS:
            channel = str(event.get("target", "")).partition("/")[2]
            channels = [channel] if channel in self.args.channel else []
        elif name in RELEASE_EVENTS:
            channels = list(self.args.channel)
        else:
            return
        for channel in channels:
            LOG.info("%s (event %s): re-rendering %s/%s", name, event.get("id"), model, channel)
            self.renderer.ask(model, channel)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--listen", default="127.0.0.1:8080", help="host:port to receive deliveries on")
    p.add_argument("--registry", default=os.environ.get("KILN_REGISTRY"), required="KILN_REGISTRY" not in os.environ)
    p.add_argument("--model", default="*", help="models to render (fnmatch, as the webhook's model_pattern)")
    p.add_argument("--channel", action="append", help="channels to render (repeatable; default prod)")
    p.add_argument("--format", action="append", help="gateway-api | kserve (repeatable; default gateway-api)")
    p.add_argument("--pool", action="append", required=True, help="hardware pool, e.g. h100:8 (repeatable)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--policy", default="latency")
    p.add_argument("--kv-cache-dtype", default="bf16")
    p.add_argument("--namespace", default="default")
    p.add_argument("--priority", type=int, default=None)
    p.add_argument("--oci-host", default=None)
    p.add_argument("--out-dir", type=Path, required=True, help="where <model>-<channel>-<format>.yaml are written")
    p.add_argument("--apply", action="store_true", help="run `kubectl apply -f` on each file written")
    p.add_argument("--kubectl", default="kubectl")
    args = p.parse_args(argv)
    args.channel = args.channel or ["prod"]
    args.format = args.format or ["gateway-api"]
    secret = os.environ.get("KILN_WEBHOOK_SECRET")
    if not secret:
        p.error("set KILN_WEBHOOK_SECRET to the webhook's secret (as given when it was created)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not a line per registry request
    host, _, port = args.listen.rpartition(":")
    server = Server((host, int(port)), secret, args)
    LOG.info("listening on http://%s:%d for %s", host, server.server_address[1], ", ".join(args.format))
    if not any(c in args.model for c in "*?["):  # one model named: render it now, not only at its next event
        for channel in args.channel:
            server.renderer.ask(args.model, channel)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
