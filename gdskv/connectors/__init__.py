"""Engine adapters: gdskv behind the KV caches of the serving engines.

- :mod:`gdskv.connectors.vllm`: ``GdskvConnector``, a vLLM v1 KV connector;
- :mod:`gdskv.connectors.sglang`: ``GdskvHiCacheStorage``, an SGLang HiCache storage backend.

Both are thin: prefix keys, lookup, load and save are the engine-neutral integration of
:mod:`gdskv.engine`, which never imports this package. Each adapter imports its engine
when it is imported; this package imports neither.
"""
