"""Prometheus metrics of the resident producer (``prefill --serve --metrics``; ``prometheus_client``,
imported only when it starts, into a registry of its own, served as text format): requests by
outcome, bytes shipped, rows computed and held, prefill and request seconds, refused handshakes,
connections open now by consumer; and, on the same port, ``/connections``: who is connected
now, as JSON (:func:`read_connections` reads it: ``muser node ls --connected``). The consumer
service's metrics are :mod:`muser_cli.service.metrics`."""

from __future__ import annotations

from typing import Any

from muser_cli.errors import ConfigError, ProtocolError, TempFailure
from muser_cli.handoff.link import format_hostport, listen_error, parse_hostport
from muser_cli.handoff.listener import LiveConnections
from muser_cli.strict import loads

#: The latency histograms' buckets, in seconds: the same in both services' registries (this
#: producer's and the consumer service's), so that their TTFTs read on one scale.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _ConnectionsGauge:
    """``muser_producer_connections{consumer}``, read from the server's open connections at each
    scrape; a consumer seen before and gone now reads 0 (its series does not vanish)."""

    def __init__(self, live: Any) -> None:
        self.live = live
        self.seen: set[str] = set()

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        gauge = GaugeMetricFamily("muser_producer_connections",
                                  "Connections open now, by consumer ('' while the TLS handshake runs)",
                                  labels=["consumer"])
        now = self.live.by_consumer()
        self.seen |= set(now)
        for consumer in sorted(self.seen):
            gauge.add_metric([consumer], now.get(consumer, 0))
        yield gauge


class ProducerMetrics:
    def __init__(self, live: Any = None) -> None:
        """``live``: the server's :class:`~muser_cli.handoff.listener.LiveConnections` (the
        connections gauge and ``/connections``), if any."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.live = live
        self.registry = r = CollectorRegistry()
        if live is not None:
            r.register(_ConnectionsGauge(live))
        self.requests = Counter("muser_producer_requests", "Pull requests, by outcome", ["outcome"], registry=r)
        self.shipped = Counter("muser_shipped_bytes", "Pack payload bytes shipped to consumers", registry=r)
        self.computed = Counter("muser_producer_rows_shipped", "Rows shipped (computed or reused here)", registry=r)
        self.held = Counter("muser_rows_held", "Rows the consumers already held (not shipped: deltas)", registry=r)
        self.reused = Counter("muser_producer_rows_reused", "Rows continued from memory or the store", registry=r)
        self.prefill = Histogram("muser_producer_prefill_seconds", "Prefill compute per request",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.total = Histogram("muser_producer_request_seconds", "Request admitted to pack shipped",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("muser_producer_ttft_seconds",
                              "Request admitted to its pack's first frame ready to ship (the producer's share of TTFT)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.refused = Counter("muser_producer_tls_refused", "Connections refused in the TLS handshake", registry=r)
        self.probes = Counter("muser_producer_probes", "Link probes, by outcome", ["outcome"], registry=r)
        # issue #39: what a consumer with a budget is told, and what it is based on
        self.queue = Gauge("muser_producer_queue", "Requests waiting for the engine (at the last admission or promise)",
                           registry=r)
        self.start = Gauge("muser_producer_expected_start_seconds",
                           "The start the producer last promised (or refused as late): seconds from the request",
                           registry=r)
        self.promises = Counter("muser_producer_promises", "Answers to requests with a budget: promised or late",
                                ["outcome"], registry=r)
        self.preemptions = Counter("muser_producer_preemptions",
                                   "Requests paused at a chunk boundary so a shorter one with an earlier deadline "
                                   "went first", registry=r)
        self.rate = Gauge("muser_producer_prefill_tokens_per_second",
                          "Measured prefill rate by depth (the end position's power-of-two bucket)", ["depth"],
                          registry=r)

    def observe(self, kind: str, f: dict[str, Any]) -> None:
        """One event of :class:`muser_cli.handoff.pull.server.PullServer`."""
        if kind == "tls_failed":
            self.refused.inc()
        elif kind == "probe":
            self.probes.labels(str(f.get("outcome"))).inc()
        elif kind == "promise":
            self.promises.labels(str(f.get("outcome"))).inc()
            self.start.set(_num(f.get("start_s")))
            self.queue.set(_num(f.get("queued")))
            self._rates(f.get("rates"))
        elif kind == "admitted":
            self.queue.set(_num(f.get("queue")))
        elif kind == "paused":
            self.preemptions.inc()
        elif kind == "warmed" or kind == "rates":
            self._rates(f.get("rates"))
        elif kind == "request":
            self.requests.labels(str(f.get("outcome"))).inc()
            self._rates(f.get("rates"))
            if f.get("outcome") != "served":
                return
            self.shipped.inc(_num(f.get("bytes")))
            self.computed.inc(_num(f.get("shipped_rows")))
            self.held.inc(_num(f.get("held_rows")))
            self.reused.inc(_num(f.get("reused_rows")))
            if f.get("prefill_s") is not None:
                self.prefill.observe(_num(f["prefill_s"]))
            if f.get("total_s") is not None:
                self.total.observe(_num(f["total_s"]))
            if f.get("first_frame_s") is not None:
                self.ttft.observe(_num(f["first_frame_s"]))

    def _rates(self, rates: Any) -> None:
        if isinstance(rates, dict):
            for depth, tps in rates.items():
                self.rate.labels(str(depth)).set(_num(tps))

    def serve(self, listen: str) -> tuple[str, int]:
        """Serve the metrics (plain HTTP, any path) and ``/connections`` (JSON) on ``listen``, on
        daemon threads; the bound address."""
        import socket
        import threading
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        from prometheus_client import make_wsgi_app
        from prometheus_client.exposition import ThreadingWSGIServer


        class Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # the library never prints
                return None

        host, port = parse_hostport(listen, listen=True)
        family, _, _, _, sockaddr = socket.getaddrinfo(host or "127.0.0.1", port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]

        class Server(ThreadingWSGIServer):
            address_family = family

        server = make_server(sockaddr[0], port, self._app(make_wsgi_app(self.registry)), Server, handler_class=Quiet)
        threading.Thread(target=server.serve_forever, name="muser-metrics", daemon=True).start()
        return server.server_address[0], server.server_address[1]

    def _app(self, metrics_app):
        """The WSGI app: ``/connections`` when this producer keeps its connections, else the metrics."""
        import json

        live = self.live

        def app(environ: dict, start_response):
            if live is None or environ.get("PATH_INFO") != "/connections":
                return metrics_app(environ, start_response)
            body = json.dumps({"connections": live.snapshot()}, sort_keys=True).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]

        return app


def serve_producer_metrics(listen: str):
    """:class:`ProducerMetrics` served on ``listen``: (its event observer, the bound address,
    the :class:`~muser_cli.handoff.listener.LiveConnections` the server is to keep its open
    connections in)."""

    live = LiveConnections()
    try:
        m = ProducerMetrics(live)
    except ImportError as exc:
        raise ConfigError(f"--metrics needs prometheus-client: {exc}", hint="pip install 'muser[serve]'") from None
    try:
        address = m.serve(listen)
    except OSError as exc:  # configuration (78), as for the service's own port
        raise listen_error(exc, listen, parse_hostport(listen, listen=True)[1]) from None
    return m.observe, address, live


def read_connections(address: str, *, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Who is connected now to the resident producer whose metrics are served on ``address``
    (``prefill --serve --metrics``): its ``/connections``. Unreachable: TempFailure (75);
    an answer that is not a producer's: ProtocolError (76)."""
    import urllib.error
    import urllib.request


    host, port = parse_hostport(address)
    url = f"http://{format_hostport(host, port)}/connections"
    hint = "give the address a producer's --metrics serves on"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback or LAN: never a proxy
    try:
        with opener.open(url, timeout=timeout) as resp:
            body = resp.read(_MAX_CONNECTIONS_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise ProtocolError(f"{address} answered /connections with HTTP {exc.code}", hint=hint) from None
    except (urllib.error.URLError, OSError) as exc:
        raise TempFailure(f"cannot reach {address}: {getattr(exc, 'reason', exc)}", hint=hint) from None
    obj = loads(body, f"{address}/connections", limit=_MAX_CONNECTIONS_BYTES, error=ProtocolError)
    conns = obj.get("connections") if isinstance(obj, dict) else None
    if not isinstance(conns, list) or not all(isinstance(c, dict) for c in conns):
        raise ProtocolError(f"{address}/connections is not a producer's list of connections", hint=hint)
    return conns


_MAX_CONNECTIONS_BYTES = 4 << 20


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else 0.0
