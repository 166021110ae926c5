"""The pull lane above the sockets: a consumer asks a resident producer for a prompt's pack.

:mod:`muser_cli.pulllane.producer`: the resident producer (``prefill --serve``), one model
loaded once, producing each request's pack; :mod:`muser_cli.pulllane.consumer`: what a
consumer asks for and how it receives it (``receive --from``, ``decode --producer``, ``batch``,
``decode --serve``). The wire and TLS ends are :mod:`muser_cli.handoff`'s pull modules.
"""
