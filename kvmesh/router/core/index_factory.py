"""The one place a ``RouterConfig`` chooses its prefix index (everything else sees a ``KvIndex``)."""

from __future__ import annotations

from kvmesh.router.core.approx_index import ApproxIndex
from kvmesh.router.core.config import RouterConfig
from kvmesh.router.core.event_index import PrefixIndex
from kvmesh.router.core.index import KvIndex
from kvmesh.router.core.predicted_index import PredictedIndex


def index_for(config: RouterConfig) -> KvIndex:
    """KV events (the default), the router's own decisions (``use_kv_events=False``), or events with
    predict-on-route beside them (``router_predicted_ttl_secs``)."""
    if not config.use_kv_events:
        return _approx(config, config.router_ttl_secs)
    events = PrefixIndex(max_entries=config.router_index_max_blocks)
    if config.router_predicted_ttl_secs is None:
        return events
    return PredictedIndex(events, _approx(config, config.router_predicted_ttl_secs))


def _approx(config: RouterConfig, ttl: float) -> ApproxIndex:
    return ApproxIndex(
        ttl=ttl, max_blocks=config.router_max_tree_size, prune_target_ratio=config.router_prune_target_ratio
    )
