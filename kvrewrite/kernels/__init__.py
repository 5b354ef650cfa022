"""kvrewrite custom ops (namespace ``kvrewrite::``).

One op per file: schema, fake, plain-PyTorch reference (the CPU path and the ground truth of the
tests). An op is a ``torch.library.custom_op`` whose kernel is the reference until its Triton kernel
lands; then it becomes a ``torch.library.triton_op`` (clustered_attention.py shows the form: CUDA
launches the kernel through ``wrap_triton``, CPU calls an opaque CPU op), so Inductor sees the kernel.
Importing this package registers every op.
"""
from kvrewrite.kernels import (  # noqa: F401
    accumulate_attention,
    attention_column_stats,
    cache_append,
    chelsea_compress,
    clustered_attention,
    clustergen_fold,
    ems_append,
    ems_attention,
    ems_compress,
    ems_merge,
    ems_partition,
    ems_redundancy,
    ems_score,
    evict_by_score,
    evict_to_budget,
    expanded_attention,
    expanded_attention_stats,
    gemv,
    gemv_glu,
    gemv_rms_norm,
    kcenter_compress,
    indexed_attention,
    kmeans_cluster,
    kvmerger_compress,
    observed_attention,
    select_clusters,
    sketch_attention,
    tp_all_gather,
    tp_all_reduce,
)
