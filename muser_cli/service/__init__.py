"""``muser decode --serve``: an OpenAI-compatible endpoint on one resident engine, each request
answered through the consumer's lane (:mod:`muser_cli.consumer`; docs/serve.md), several at once
taking the engine's turns; and the consumer service's Prometheus metrics (the producer's are
:mod:`muser_cli.pulllane.metrics`).

Modules: :mod:`.api` (request and response shapes, no framework), :mod:`.textstream`
(text as tokens are decided), :mod:`.worker` (the engine behind its turns, the bounded queue,
the running requests), :mod:`.metrics` (prometheus_client), :mod:`.app` (Starlette on uvicorn).
Starlette, uvicorn and prometheus_client are the optional ``serve`` extra: imported only when a
service starts.
"""
