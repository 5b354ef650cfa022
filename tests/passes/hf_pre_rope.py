"""HF's own pre-RoPE keys of a model, for the tests of kvrewrite/passes/pre_rope.py and of the append_call hook."""
import sys

import torch


def hf_pre_rope_keys(model, ids) -> dict:
    """{layer: the key HF passes to apply_rotary_pos_emb} for one forward on ids (layers without RoPE absent)."""
    rec, current, hooks = {}, [None], []
    for m in model.modules():
        if isinstance(getattr(m, "layer_idx", None), int):
            hooks.append(m.register_forward_pre_hook(lambda mod, args: current.__setitem__(0, mod.layer_idx)))
    module = sys.modules[type(model).__module__]
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is not None:
        def recording(q, k, *args, **kwargs):
            rec[current[0]] = k.detach().clone()
            return original(q, k, *args, **kwargs)

        module.apply_rotary_pos_emb = recording
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        if original is not None:
            module.apply_rotary_pos_emb = original
        for h in hooks:
            h.remove()
    return rec
