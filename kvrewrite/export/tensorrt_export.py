"""TensorRT target (torch-tensorrt): one serialized engine program per rewritten graph, every
kvrewrite op a TensorRT plugin generated from the op itself (the Quick Deployable Plugin path).

What it does, per graph:
1. makes the graph functional (kvrewrite.export.functional, with the triton_ops clustered_attention,
   select_clusters, indexed_attention and sketch_attention as the opaque kvrewrite_export ops of the same names):
   TensorRT plugins return new tensors, they cannot write their inputs; inputs (input_ids,
   position_ids, cache_position, token_valid, *state), outputs (logits, *new_state);
2. torch.export-s it and checks its op set: only ATen ops and the kvrewrite_export ops of
   PLUGIN_OPS, each with a plugin description (output shapes as functions of the input shapes,
   derived from the op's fake the way torch-tensorrt's generate_plugin derives them);
3. registers each op with `torch_tensorrt.dynamo.conversion.plugins.custom_op(name)`, which
   generates the QDP plugin (descriptor from the fake; JIT implementation that calls the torch op,
   i.e. kvrewrite's Triton kernels on CUDA, on TensorRT's stream) and its converter;
4. compiles with `torch_tensorrt.dynamo.compile(ep, arg_inputs=..., require_full_compilation=True,
   min_block_size=1)` and saves with `torch_tensorrt.save(..., output_format="exported_program")`.

What has been run: steps 1-2 (tests/export/test_tensorrt.py, CPU). Steps 3-4 are written against the
documented torch-tensorrt API (2.6+, TensorRT >= 10.7 for tensorrt.plugin) and have never run: neither
package can be installed on our machines. Without them `tensorrt()` raises ImportError naming what is
missing. The plugins are JIT plugins (a Python callback into the op at engine run time): an AOT plugin
(`tensorrt.plugin.aot_impl`, PTX in the engine) needs one Triton kernel with a fixed launch per op, and
cache_append / the compression ops launch several kernels or run PyTorch code (kmeans_cluster, select_clusters,
kvmerger_compress: several phases or launches); so the engines need a Python process with kvrewrite imported,
like the AOTInductor packages. (kvmerger_compress's options reach its plugin as int, float and str attributes;
ClusterGen's sketch_attention is opaque like clustered_attention, clustergen_fold returns its thirteen written fields
and takes its options as int and float attributes, clustergen-kcenter's kcenter_compress returns the base five; EMS's
ems_append returns the seven slot-table fields it writes, ems_attention its output then the four statistics fields,
ems_compress the fifteen fields it writes, their options int, float and bool attributes.)
"""
import operator

import torch

from kvrewrite.export.common import INPUT_NAMES, check_exportable, check_graphs, example_inputs, graph_of, metadata, \
    out_dir, write_metadata
from kvrewrite.export.functional import functionalize, gemv_as_linear

PLUGIN_OPS = (
    "kvrewrite_export::cache_append",
    "kvrewrite_export::clustered_attention",
    "kvrewrite_export::evict_to_budget",
    "kvrewrite_export::chelsea_compress",
    "kvrewrite_export::evict_by_score",
    "kvrewrite_export::accumulate_attention",
    "kvrewrite_export::kmeans_cluster",
    "kvrewrite_export::select_clusters",
    "kvrewrite_export::indexed_attention",
    "kvrewrite_export::kvmerger_compress",
    "kvrewrite_export::sketch_attention",
    "kvrewrite_export::clustergen_fold",
    "kvrewrite_export::kcenter_compress",
    "kvrewrite_export::ems_append",
    "kvrewrite_export::ems_attention",
    "kvrewrite_export::ems_compress",
)
_ALLOWED_NON_TENSOR = (int, float, bool, str)  # what generate_plugin maps to plugin attributes
_registered = set()


def require_tensorrt():
    """Import torch_tensorrt and tensorrt.plugin, or raise ImportError naming what is missing."""
    missing = []
    try:
        import torch_tensorrt  # noqa: F401
    except ImportError:
        missing.append("torch_tensorrt (pip install torch-tensorrt, matching your torch)")
    try:
        import tensorrt.plugin  # noqa: F401
    except ImportError:
        missing.append("tensorrt.plugin (TensorRT >= 10.7, the Quick Deployable Plugin API)")
    if missing:
        raise ImportError("kvrewrite.export.tensorrt needs " + " and ".join(missing) + "; neither is importable here")


def trt_graph(rw, name: str):
    """The functional graph handed to torch-tensorrt (see the module docstring, step 1)."""
    return gemv_as_linear(functionalize(graph_of(rw, name), n_inputs=len(INPUT_NAMES), opaque_attention=True))


def export_graph(rw, name: str) -> torch.export.ExportedProgram:
    return torch.export.export(trt_graph(rw, name), example_inputs(rw, name), strict=False)


def non_aten_ops(ep) -> dict:
    """{op name ("ns::name"): [nodes]} of every call that is not an ATen op (getitem aside)."""
    ops = {}
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "aten":
            continue
        name = node.target.name().split(".")[0] if isinstance(node.target, torch._ops.OpOverload) else str(node.target)
        ops.setdefault(name, []).append(node)
    return ops


def check_op_set(ep) -> list:
    """The kvrewrite ops of `ep`; ValueError if it calls anything else outside ATen."""
    ops = non_aten_ops(ep)
    bad = sorted(set(ops) - set(PLUGIN_OPS))
    if bad:
        raise ValueError(f"tensorrt: the graph calls {bad}, which are neither ATen ops nor kvrewrite ops with a "
                         f"TensorRT plugin ({list(PLUGIN_OPS)})")
    return sorted(ops)


def plugin_description(op_name: str, args: list) -> dict:
    """{"inputs": [shape of each tensor input], "outputs": [shape of each output]}, every dim a sympy
    expression of fresh per-input-dim symbols (as generate_plugin's descriptor builds them), the outputs
    computed by the op's fake. ValueError if an argument has a type a QDP plugin cannot take, or an
    output dim is data-dependent (unbacked)."""
    from torch._dynamo.source import LocalSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, free_unbacked_symbols

    ns, name = op_name.split("::")
    op = getattr(getattr(torch.ops, ns), name).default
    for a, schema_arg in zip(args, op._schema.arguments):
        if not isinstance(a, torch.Tensor) and not isinstance(a, _ALLOWED_NON_TENSOR):
            raise ValueError(f"{op_name}: argument {schema_arg.name}={a!r} ({type(a).__name__}) cannot be a plugin "
                             f"attribute (int, float, bool, str)")
    env = ShapeEnv()
    fake_args, in_shapes, k = [], [], 0
    with FakeTensorMode(shape_env=env):
        for a in args:
            if isinstance(a, torch.Tensor):
                dims = []
                for d in a.shape:
                    src = LocalSource(f"in{k}")
                    k += 1
                    dims.append(env.create_symintnode(env.create_symbol(int(d), source=src,
                                                                        dynamic_dim=DimDynamic.DYNAMIC),
                                                      hint=int(d), source=src))
                fake_args.append(torch.empty(dims, dtype=a.dtype))
                in_shapes.append([d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in dims])
            else:
                fake_args.append(a)
        out = op(*fake_args)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    shapes = []
    for o in outs:
        exprs = [d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in o.shape]
        if any(isinstance(d, torch.SymInt) and free_unbacked_symbols(d) for d in o.shape):
            raise ValueError(f"{op_name}: output shape {exprs} depends on data")
        shapes.append(exprs)
    return {"inputs": in_shapes, "outputs": shapes}


def _example_values(node):
    """Concrete arguments of a node in schema order (kwargs folded in, omitted defaults left out): tensors
    from the export's example values, constants as is."""
    names = [a.name for a in node.target._schema.arguments[len(node.args):]]
    vals = []
    for a in [*node.args, *(node.kwargs[n] for n in names if n in node.kwargs)]:
        if isinstance(a, torch.fx.Node):
            v = a.meta["val"]
            vals.append(torch.empty(v.shape, dtype=v.dtype))
        else:
            vals.append(a)
    return vals


def prepare(rw, graphs=None) -> dict:
    """Steps 1-2 for each graph: {graph: (ExportedProgram, {op: plugin description of its first call})}."""
    out = {}
    for name in check_graphs(graphs):
        ep = export_graph(rw, name)
        descs = {}
        for op_name, nodes in non_aten_ops(ep).items():
            if op_name in PLUGIN_OPS:
                descs[op_name] = plugin_description(op_name, _example_values(nodes[0]))
        check_op_set(ep)
        out[name] = (ep, descs)
    return out


def register_plugins() -> None:
    """Step 3: a QDP plugin and converter per kvrewrite op (once per process)."""
    from torch_tensorrt.dynamo.conversion.plugins import custom_op

    for op_name in PLUGIN_OPS:
        if op_name not in _registered:
            custom_op(op_name, supports_dynamic_shapes=False)
            _registered.add(op_name)


def tensorrt(rw, path, graphs=None, **compile_kwargs):
    """Compile each graph (default: all three) with torch-tensorrt, the kvrewrite ops as plugins, and
    save <path>/<graph>.ep plus <path>/kvrewrite_export.json. CUDA only. Returns the directory.

    `compile_kwargs` go to torch_tensorrt.dynamo.compile (e.g. enabled_precisions)."""
    check_exportable(rw)
    require_tensorrt()
    import torch_tensorrt

    if rw.l0_fill.device.type != "cuda":
        raise ValueError(f"tensorrt: the model is on {rw.l0_fill.device}; TensorRT needs it on CUDA (rw.to('cuda') "
                         f"before kvrewrite.apply, or apply to a CUDA model)")
    register_plugins()
    d = out_dir(path)
    files = {}
    for name, (ep, _) in prepare(rw, graphs).items():
        inputs = list(example_inputs(rw, name))
        settings = dict(require_full_compilation=True, min_block_size=1) | compile_kwargs
        trt_gm = torch_tensorrt.dynamo.compile(ep, arg_inputs=inputs, **settings)
        files[name] = f"{name}.ep"
        torch_tensorrt.save(trt_gm, str(d / files[name]), output_format="exported_program", arg_inputs=inputs)
    write_metadata(d, metadata(rw, "tensorrt", files))
    return d
