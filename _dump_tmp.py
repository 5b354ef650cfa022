import sys, torch
from tests.families import tiny_model
from kvrewrite.capture import capture, layer_of
fam = sys.argv[1]
m = tiny_model(fam, attn="eager")
cap = capture(m, batch_size=2, prefill_chunk=16)
for kind, gm in cap.graphs.items():
    print("=====", kind)
    for n in gm.graph.nodes:
        if layer_of(n) == 0 and n.op == "call_function":
            v = n.meta.get("val")
            print(n.name, n.target, [a.name if hasattr(a,'name') else a for a in n.args], n.kwargs, tuple(v.shape) if hasattr(v,'shape') else v, getattr(v,'dtype',None), len(n.users))
