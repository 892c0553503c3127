"""The old module path of the vLLM connector, which now lives in :mod:`gdskv.connectors.vllm`.

Engine configs that name ``kv_connector_module_path="gdskv.engine.vllm"`` keep working:
this module re-exports the connector's public names (the same objects). New configs
should name ``gdskv.connectors.vllm``.
"""

from gdskv.connectors.vllm import GdskvConnector, GdskvConnectorMetadata, PageSpan, connectors

__all__ = ["GdskvConnector", "GdskvConnectorMetadata", "PageSpan", "connectors"]
