"""vLLM as muser's producer: a KV connector loaded by vLLM, and ``--engine vllm``.

One idea per module (importing this package imports neither vLLM nor torch):

* :mod:`.config`    the connector's JSON config (``kv_transfer_config``), validated
* :mod:`.planner`   scheduler side: vLLM's SchedulerOutput -> a JSON save plan
* :mod:`.layouts`   which cache layout each vLLM backend writes; unchecked ones refused
* :mod:`.gather`    paged cache -> token-ordered rows, one reader per layout
* :mod:`.fp8`       fp8 cache bytes -> float32
* :mod:`.assembler` worker side: save plans applied to the caches, rows to a sink
* :mod:`.sinks`     spool directory / kvpack file / error file
* :mod:`.connector` the vLLM-facing ``MuserConnector`` class (imports vLLM on access)
* :mod:`.options`   engine options (``MUSER_VLLM_OPTS``) and CPU/GPU defaults
* :mod:`.engine`    ``VLLMEngine``: ``--engine vllm``

The old module path ``muser_cli.engines.vllm_connector`` is a shim over :mod:`.connector`
(a vLLM config naming it still loads).
"""
