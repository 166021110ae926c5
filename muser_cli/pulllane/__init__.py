"""The pull lane above the sockets: a consumer asks a resident producer for a prompt's pack.

:mod:`muser_cli.pulllane.producer`: the resident producer (``prefill --serve``), one model
loaded once, producing each request's pack; :mod:`muser_cli.consumer.pull`: what a
consumer asks for and how it receives it (``receive --from``, ``decode --producer``, ``batch``,
``decode --serve``; ``node check``, a consumer's question whether a producer is ready to serve
it, is :mod:`muser_cli.consumer.node_check`); :mod:`muser_cli.pulllane.metrics`: the resident
producer's Prometheus metrics. The wire and TLS ends are :mod:`muser_cli.handoff`'s pull modules.
"""
