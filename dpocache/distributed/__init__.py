"""More than one process: the process group and its collectives (``process_group``), FSDP2 for
the policy (``fsdp``), the reference sharded over the ranks (``sharded_reference``) and the
vocabulary tables used without gathering them (``vocab_stream``)."""

from dpocache.imports import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(__name__, {
    "dpocache.distributed.process_group": [
        "DistEnv", "init_distributed", "check_backend", "barrier", "all_reduce_sum", "all_reduce_max",
        "reduce_counts", "differing_on_ranks", "broadcast_object", "destroy", "device_mesh",
        "release_group_references", "split_by_weight"
    ],
    "dpocache.distributed.sharded_reference": ["ShardedReference", "load_sharded_reference"],
})
