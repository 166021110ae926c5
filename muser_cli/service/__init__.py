"""``muser decode --serve``: an OpenAI-compatible endpoint on one resident engine, each request
the pull lane (docs/serve.md); and the Prometheus metrics of both services.

Modules: :mod:`.api` (request and response shapes, no framework), :mod:`.textstream`
(text as tokens are decided), :mod:`.worker` (the engine, its bounded queue, one request),
:mod:`.metrics` (prometheus_client), :mod:`.app` (Starlette on uvicorn). Starlette, uvicorn
and prometheus_client are the optional ``serve`` extra: imported only when a service starts.
"""
