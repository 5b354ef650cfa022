"""Deployment targets for a KVRewrittenModel: torch.export (.pt2), AOTInductor, ONNX, TensorRT.

    kvrewrite.export.torch_export(rw, "out/pt2")   # ExportedPrograms (pt2.py)
    kvrewrite.export.aoti(rw, "out/aoti")           # AOTInductor packages (aot_inductor.py)
    kvrewrite.export.onnx(rw, "out/onnx")           # ONNX, kvrewrite ops as custom-domain functions (onnx_export.py)
    kvrewrite.export.tensorrt(rw, "out/trt")        # torch-tensorrt + Quick Deployable Plugins (tensorrt_export.py)
    m = kvrewrite.export.loader.load("out/pt2"); m.generate(ids, mask, max_new_tokens=32)

Every target writes one artifact per rewritten graph (prefill chunk, decode step, decode step with
compression) and kvrewrite_export.json, which holds what the loader needs to reproduce
`rw.generate` (kvrewrite/host.py is the host logic both share). docs/deploy.md has a worked example
and the limits of each target. Optional dependencies (onnx, onnxscript, onnxruntime, torch_tensorrt)
are imported only by the target that needs them.
"""
from kvrewrite.export import functional  # noqa: F401  (registers kvrewrite_export::)
from kvrewrite.export.aot_inductor import aoti
from kvrewrite.export.onnx_export import onnx
from kvrewrite.export.pt2 import torch_export
from kvrewrite.export.tensorrt_export import tensorrt

__all__ = ["torch_export", "aoti", "onnx", "tensorrt"]
