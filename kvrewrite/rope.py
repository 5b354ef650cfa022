"""RoPE whose frequencies depend on the sequence length: exact up to a threshold, refused beyond it.

Most RoPE types (default, linear, yarn, llama3, ...) compute fixed frequencies once; the captured graph
then holds them and is exact at every position. Two types recompute them inside HF's forward from
max(position_ids) + 1 (transformers' `dynamic_rope_update`):

- "dynamic" (NTK): new, larger-base frequencies once the sequence grows past max_position_embeddings
  (the rotary module's `original_max_seq_len`); below it, the original ones.
- "longrope" (Phi-3-128k, Phi-3.5): the short factors up to `original_max_position_embeddings`, the
  long factors past it, switched per forward call.

A captured graph cannot follow that switch (a data-dependent branch: torch.export refuses it), so the
capture traces the rotary forward without the update, on the original frequencies: exactly what HF
computes while every position stays below the threshold. `apply` therefore requires
max_length <= threshold for such models and refuses a larger max_length naming the model type, the RoPE
type and the threshold (`check_max_length`).
"""
import contextlib
import inspect
import types

import torch

SEQ_LEN_DEPENDENT = ("dynamic", "longrope")


def _dependent(model):
    """(name, module, {prefix: rope type}) of every rotary module with a seq-len-dependent frequency set; the
    prefix is '' for one set of frequencies, '<layer_type>_' per layer type (Gemma-3's per-type rotaries)."""
    for name, module in model.named_modules():
        rt = getattr(module, "rope_type", None)
        if not isinstance(rt, (str, dict)):
            continue
        sets = {"": rt} if isinstance(rt, str) else {f"{k}_": v for k, v in rt.items()}
        dependent = {p: t for p, t in sets.items() if any(k in t for k in SEQ_LEN_DEPENDENT) and hasattr(module, f"{p}inv_freq")}
        if dependent:
            yield name or "<model>", module, dependent


def _threshold(module, prefix: str, rope_type: str) -> int:
    """The largest sequence length (max position + 1) at which HF still uses the original frequencies."""
    if "dynamic" in rope_type:
        return int(getattr(module, f"{prefix}original_max_seq_len", module.original_max_seq_len))
    params = module.config.rope_parameters
    params = params[prefix[:-1]] if prefix else params
    return int(params["original_max_position_embeddings"])


def seq_len_dependent_ropes(model) -> list:
    """[(module name, rope type, threshold)] for every rotary module of `model` whose frequencies depend on
    the sequence length."""
    return [(name, rt, _threshold(module, prefix, rt))
            for name, module, dependent in _dependent(model) for prefix, rt in dependent.items()]


def check_max_length(model, max_length: int, model_tag: str) -> None:
    """ValueError when max_length goes past a threshold where HF would switch RoPE frequencies."""
    for name, rt, limit in seq_len_dependent_ropes(model):
        if max_length > limit:
            what = ("dynamic (NTK) RoPE: frequencies that grow with the sequence length past "
                    f"max_position_embeddings={limit}" if "dynamic" in rt else
                    f"LongRoPE: HF switches from the short to the long factors past "
                    f"original_max_position_embeddings={limit}")
            raise ValueError(
                f"{model_tag}: {what} ({name}) are not supported; kvrewrite is exact up to {limit} tokens: "
                f"apply(..., max_length=<= {limit}) (asked for max_length={max_length})")


@contextlib.contextmanager
def original_frequencies(model):
    """Trace every seq-len-dependent rotary module without its frequency update, on the original frequencies
    (an instance attribute shadows the decorated forward while the block runs; the class is untouched)."""
    patched = []
    for _, module, dependent in _dependent(model):
        forward = type(module).forward
        undecorated = inspect.unwrap(forward)  # past no_grad and dynamic_rope_update (both functools.wraps)
        if undecorated is forward:
            raise RuntimeError(f"{type(module).__name__}.forward has no undecorated __wrapped__ forward to trace")
        for p in dependent:
            original = getattr(module, f"{p}original_inv_freq")
            buf = getattr(module, f"{p}inv_freq")
            with torch.no_grad():
                buf.copy_(original.to(buf.device, buf.dtype))
        module.forward = types.MethodType(undecorated, module)
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward
