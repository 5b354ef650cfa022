"""Compression methods, one per file. METHODS maps each registry name to its class."""
from kvrewrite.methods.base import Method
from kvrewrite.methods.chelsea import ChelseaMethod
from kvrewrite.methods.clustergen import ClusterGenMethod
from kvrewrite.methods.clustergen_kcenter import ClusterGenKCenterMethod
from kvrewrite.methods.clusterkv import ClusterKVMethod
from kvrewrite.methods.ems import EMSMethod
from kvrewrite.methods.full import FullMethod
from kvrewrite.methods.h2o import H2OMethod
from kvrewrite.methods.kvmerger import KVMergerMethod
from kvrewrite.methods.snapkv import SnapKVMethod
from kvrewrite.methods.streamingllm import StreamingLLMMethod

METHODS = {m.name: m for m in (FullMethod, StreamingLLMMethod, ChelseaMethod, H2OMethod, SnapKVMethod,
                               ClusterKVMethod, KVMergerMethod, EMSMethod, ClusterGenMethod, ClusterGenKCenterMethod)}


def make_method(method, budget=None, **kwargs) -> Method:
    """A Method instance from a registry name (or pass an instance through)."""
    if isinstance(method, Method):
        if budget is not None or kwargs:
            raise ValueError("kvrewrite.apply: give budget/method options in the Method instance, not both")
        return method
    if method not in METHODS:
        raise ValueError(f"kvrewrite.apply: unknown method {method!r}; known methods: {', '.join(sorted(METHODS))}")
    if budget is not None:
        kwargs["budget"] = budget
    try:
        return METHODS[method](**kwargs)
    except TypeError as e:
        raise ValueError(f"kvrewrite.apply: bad option for method {method!r}: {e}") from None
