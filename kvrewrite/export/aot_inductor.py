"""AOTInductor target: one compiled package (.pt2) per rewritten graph, plus the metadata JSON.

Each graph is torch.export-ed (kvrewrite.export.pt2) and compiled by
`torch._inductor.aoti_compile_and_package` for the device the model is on: C++ on CPU, and on CUDA
generated Triton kernels plus the own Triton kernels of kvrewrite::clustered_attention and
kvrewrite::cache_append (triton_ops, so Inductor compiles them into the package). The in-place state
updates are applied to the caller's tensors, as in the runtime. `kvrewrite.export.loader.load(path)`
runs generation from the directory.

What is not compiled into the package: ops that are plain custom ops (evict_to_budget,
chelsea_compress, evict_by_score, kmeans_cluster, kvmerger_compress, and the CPU paths of the triton_ops
clustered_attention, select_clusters and indexed_attention) run through AOTInductor's proxy executor, which calls
the registered op, i.e. the kvrewrite Python implementation (on CUDA its Triton compression kernels). So a package runs
in a Python process that has done `import kvrewrite`; it is not a C++-only artifact.

Workaround: AOTInductor's proxy executor passes an empty int list argument as None (torch 2.13), so
chelsea_compress's `outlier_heads=[]` would fail at run time; the graph exported here calls
kvrewrite_export::chelsea_compress_masked instead, the same in-place op with the outlier heads as
a bit mask (an int), which calls kvrewrite::chelsea_compress.
"""
import torch

from kvrewrite.export.common import example_inputs, graph_of, write_export
from kvrewrite.export.functional import all_args, outlier_heads, outlier_mask
from kvrewrite.inductor_fallback_log import shallow_operator_str

torch.library.define(
    "kvrewrite_export::chelsea_compress_masked",
    "(Tensor(a0!) keys, Tensor(a1!) values, Tensor(a2!) bias, Tensor(a3!) slot_pos, Tensor(a4!) fill, Tensor budget, "
    "int n_sink, int n_recent, int chunk, float r_init, float r_alpha, int r_steps, float r_min, "
    "int outlier_mask) -> ()",
)


@torch.library.impl("kvrewrite_export::chelsea_compress_masked", "CompositeExplicitAutograd")
def _chelsea_masked(keys, values, bias, slot_pos, fill, budget, n_sink, n_recent, chunk, r_init, r_alpha, r_steps,
                    r_min, outlier_mask):
    torch.ops.kvrewrite.chelsea_compress(keys, values, bias, slot_pos, fill, budget, n_sink, n_recent, chunk, r_init,
                                         r_alpha, r_steps, r_min, outlier_heads(outlier_mask, keys.shape[1]))


@torch.library.register_fake("kvrewrite_export::chelsea_compress_masked")
def _(*args):
    return None


def _mask_outlier_lists(gm):
    """A copy of `gm` whose chelsea_compress calls take the outlier heads as a bit mask."""
    from kvrewrite.capture import copy_graph_module

    gm = copy_graph_module(gm)
    op = torch.ops.kvrewrite.chelsea_compress.default
    for node in gm.graph.find_nodes(op="call_function", target=op):
        args = all_args(node)
        args[-1] = outlier_mask(args[-1])
        node.target = torch.ops.kvrewrite_export.chelsea_compress_masked.default
        node.args, node.kwargs = tuple(args), {}
    gm.recompile()
    return gm


def aoti(rw, path, graphs=None, inductor_configs=None):
    """Compile <path>/<graph>.pt2 (AOTInductor packages) for each graph (default: all three) on rw's
    device, and write <path>/kvrewrite_export.json. Returns the directory."""
    def save(name, file):
        gm = _mask_outlier_lists(graph_of(rw, name))
        ep = torch.export.export(gm, example_inputs(rw, name), strict=False)
        with shallow_operator_str():  # the ops' fallback messages without their inputs' whole IR
            torch._inductor.aoti_compile_and_package(ep, package_path=str(file), inductor_configs=inductor_configs or {})

    return write_export(rw, path, graphs, "aoti", ".pt2", save)
