"""Store metrics (Spark's StateStoreMetrics and its custom metrics)."""
import dataclasses

__all__ = ["StateStoreCustomMetric", "StateStoreMetrics", "FILE_PROVIDER_CUSTOM_METRICS"]


@dataclasses.dataclass(frozen=True)
class StateStoreCustomMetric:
    """A provider-specific metric: ``kind`` is "sum", "size" or "timing" (how Spark shows it)."""

    name: str
    desc: str
    kind: str = "sum"


# What FileStateStoreProvider reports, named as Spark's HDFS provider names them (docs/spark-state-store.md, The store contract).
FILE_PROVIDER_CUSTOM_METRICS = (
    StateStoreCustomMetric("stateOnCurrentVersionSizeBytes", "estimated size of state only on current version",
                           "size"),
    StateStoreCustomMetric("loadedMapCacheHitCount", "count of cache hit on states cache in provider"),
    StateStoreCustomMetric("loadedMapCacheMissCount", "count of cache miss on states cache in provider"),
    StateStoreCustomMetric("rolledForwardCount",
                           "count of versions reached from the one in memory by the deltas since"),
)


@dataclasses.dataclass(frozen=True)
class StateStoreMetrics:
    """Keys, memory, and custom metrics (a dict keyed by metric name) of one store."""

    num_keys: int
    memory_used_bytes: int
    custom_metrics: dict = dataclasses.field(default_factory=dict)

    @staticmethod
    def combine(all_metrics):
        """Sum keys, memory and each custom metric by name, over many stores."""
        num_keys = memory = 0
        custom = {}
        for m in all_metrics:
            num_keys += m.num_keys
            memory += m.memory_used_bytes
            for name, value in m.custom_metrics.items():
                custom[name] = custom.get(name, 0) + value
        return StateStoreMetrics(num_keys, memory, custom)
