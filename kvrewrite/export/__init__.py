"""Deployment targets for a KVRewrittenModel: torch.export (.pt2), AOTInductor, ONNX, TensorRT.

One target per file (torch_export.py, aoti.py, onnx.py, tensorrt.py). The targets land with the
deployment issue (#6); the rewritten graphs are already plain GraphModules whose only non-ATen nodes
are kvrewrite ops, taking the layer state as explicit inputs, which is what they will export.
"""
