"""ONNX target: one .onnx model per rewritten graph, kvrewrite ops as custom-domain functions.

Each graph is made functional (kvrewrite.export.functional: inputs (input_ids, position_ids,
cache_position, token_valid, *state), outputs (logits, *new_state), named l<i>_<field>) and exported
with torch.onnx.export(dynamo=True). Every kvrewrite op becomes a node of domain "kvrewrite" (emitted
through torch.onnx.ops.symbolic), and the model carries the op's FunctionProto (the reference
computation in standard ONNX ops, kvrewrite/export/onnx_ops.py). The functions are attached after
torch.onnx.export: its opset conversion inlines every model-local function, which would dissolve the
custom nodes (a custom_translation_table with onnxscript functions ends up inlined that way). onnxruntime
runs the model as it is; a runtime with a native kvrewrite kernel can substitute it by domain/name.
onnx.checker.check_model(full_check=True) runs on every model written.

Every op a method inserts has a function: methods full, streamingllm, chelsea, h2o, snapkv, clusterkv and
kvmerger export completely (sliding-window layers included; the method's own state, e.g. l<i>_score, ClusterKV's
l<i>_centroids ... l<i>_cluster_end or KVMerger's l<i>_degree and l<i>_deficit, is an input and an output like the
base state; ClusterKV's functions are in onnx_clusterkv.py, KVMerger's in onnx_kvmerger.py).
kvrewrite::attention_column_stats (no method calls it directly; its math is inside accumulate_attention) has none;
a graph holding it is refused with NotImplementedError. Method clustergen-kcenter exports completely (its
kcenter_compress function is in onnx_clustergen.py); method clustergen does not: kvrewrite::clustergen_fold (in its
prefill and decode_compress graphs) has no function, and export_graph refuses those graphs with a NotImplementedError
naming the op and the method and pointing to torch_export / aoti (INSTEAD); its sketch_attention has a function
(onnx_clustergen.py), so the decode graph alone exports. Method ems exports completely: ems_append, ems_attention and
ems_compress have functions (onnx_ems.py; ems_compress's body calls its stages' functions).
"""
import torch

from kvrewrite.export.common import GRAPHS, INPUT_NAMES, example_inputs, graph_of, write_export
from kvrewrite.export.functional import all_args, functionalize, gemv_as_linear, state_names

OPSET = 18
UNSUPPORTED = {torch.ops.kvrewrite.attention_column_stats.default: "attention_column_stats",
               torch.ops.kvrewrite.clustergen_fold.default: "clustergen_fold"}
# why an op has no function, and what to do instead (appended to the NotImplementedError)
INSTEAD = {
    "clustergen_fold": "ClusterGen's fold (method 'clustergen': leader clustering one folded token after another, "
                       "k-center calibration, hashed reservoirs) has no ONNX function; export this method with "
                       "kvrewrite.export.torch_export (.pt2) or kvrewrite.export.aoti (AOTInductor), which run the op "
                       "as it is and reproduce rw.generate (docs/deploy.md, \"ClusterGen\")",
}


def _require():
    missing = []
    for mod in ("onnx", "onnxscript"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise ImportError(f"kvrewrite.export.onnx needs {' and '.join(missing)} (pip install onnx onnxscript; "
                          f"onnxruntime to run the models)")


def unsupported_ops(gm) -> list:
    """Names of the kvrewrite ops in `gm` that have no ONNX function."""
    calls = (n for n in gm.graph.nodes if n.op == "call_function")
    return sorted({UNSUPPORTED[n.target] for n in calls if n.target in UNSUPPORTED})


def symbolic_graph(gm):
    """The functional graph with every kvrewrite op replaced by its kvrewrite::<op> ONNX node."""
    from kvrewrite.export.onnx_ops import SYMBOLIC

    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SYMBOLIC:
            node.target, node.args, node.kwargs = SYMBOLIC[node.target], tuple(all_args(node)), {}
    gm.recompile()
    return gm


def export_graph(rw, name: str):
    """The onnx.ModelProto of one graph: exported, kvrewrite functions attached, checked."""
    _require()
    import onnx as onnx_lib

    from kvrewrite.export.onnx_ops import function_protos

    gm = graph_of(rw, name)
    bad = unsupported_ops(gm)
    if bad:
        raise NotImplementedError(
            f"{rw.model_tag}: the {name} graph of method {rw.method.name!r} holds kvrewrite op(s) {bad}, which have "
            f"no ONNX function yet (see kvrewrite/export/onnx_export.py); graphs without them: "
            f"{[g for g in GRAPHS if not unsupported_ops(graph_of(rw, g))]}"
            + "".join(f". {INSTEAD[op]}" for op in bad if op in INSTEAD))
    sgm = symbolic_graph(gemv_as_linear(functionalize(gm, n_inputs=len(INPUT_NAMES)))).eval()
    names = state_names(rw.layers, rw.state_specs)
    with torch.no_grad():
        program = torch.onnx.export(
            sgm, example_inputs(rw, name), dynamo=True, opset_version=OPSET,
            input_names=[*INPUT_NAMES, *names], output_names=["logits", *[f"{n}_out" for n in names]],
            external_data=False,
        )
    model = program.model_proto
    model.functions.extend(function_protos({n.op_type for n in model.graph.node if n.domain == "kvrewrite"}))
    onnx_lib.checker.check_model(model, full_check=True)
    return model


def onnx(rw, path, graphs=None):
    """Write <path>/<graph>.onnx for each graph (default: all three) and <path>/kvrewrite_export.json.

    Returns the directory; `kvrewrite.export.loader.load(path)` runs generation through onnxruntime.
    """
    import onnx as onnx_lib

    return write_export(rw, path, graphs, "onnx", ".onnx",
                        lambda name, file: onnx_lib.save(export_graph(rw, name), str(file)), onnx_opset=OPSET)
