"""kvrewrite: compress the KV cache of Hugging Face causal LMs by rewriting their graph.

    rw = kvrewrite.apply(model, method="chelsea", budget=0.2)
    out = rw.generate(input_ids, attention_mask=mask, max_new_tokens=64)

    state = rw.prefill_context(context_ids)       # compress a document once (docs/context.md)
    out = rw.generate(question_ids, context=state, max_new_tokens=64)   # ask it many questions

    pipe = kvrewrite.pipeline("smollm2-135m", method="chelsea", budget=0.2)   # text in, answers out
    pipe(["Who?", "When?"], context=document)
"""
import logging

from kvrewrite import kernels  # noqa: F401  (registers the kvrewrite:: ops)
from kvrewrite.context_cache import ContextState
from kvrewrite.methods import METHODS, make_method
from kvrewrite.text_pipeline import TextPipeline, pipeline
from kvrewrite.verification import VerifyReport, verify

logger = logging.getLogger(__name__)
__all__ = ["apply", "pipeline", "TextPipeline", "ContextState", "verify", "VerifyReport", "METHODS"]
DEFAULT_MAX_LENGTH = 4096


def apply(model, method="chelsea", budget=None, *, max_length=None, batch_size=1, prefill_chunk=256, captured=None,
          fuse_projections=False, gemv=False, verify="auto", tp=1, tp_all_reduce="auto", **method_kwargs):
    """Capture `model`, rewrite its attention and KV cache for `method`, return a KVRewrittenModel.

    Args:
        model: a Hugging Face causal LM (the tested families: README "Supported models"; other model types are
            verified first, see `verify`).
        method: a name in METHODS, or a Method instance.
        budget: fraction of the tokens kept per KV head, in (0, 1] (the method's default if None).
        max_length: longest prompt + generation the state is sized for
            (default: min(model's max_position_embeddings, 4096)).
        batch_size: static batch size of the captured graphs.
        prefill_chunk: tokens per prefill step; the prompt is left-padded to a multiple of it.
        captured: the result of `kvrewrite.capture.capture(model, ...)` to rewrite instead of capturing
            again (capture is most of apply's time; kvrewrite.eval rewrites one capture for every
            method). Its batch size and prefill chunk are used; `batch_size`/`prefill_chunk` are ignored.
        fuse_projections: one matmul for q/k/v and one for gate/up (faster decode on a GPU). It rebinds
            the model's own q/k/v and gate/up weights as views into the fused tensors: no extra memory and
            the same values, but safetensors' save_pretrained then refuses the shared storage (see
            kvrewrite/passes/fuse_projections.py). Off by default for that reason.
        gemv: with batch_size 1, run the decode graphs' matrix-vector products through kvrewrite's Triton GEMV
            instead of cuBLAS on a GPU (faster decode; the CPU computes F.linear as before). Results differ
            from cuBLAS's by rounding; see kvrewrite/passes/replace_linear_with_gemv.py. Off by default.
        verify: "auto" (default): a model type outside the tested matrix (kvrewrite.capture.SUPPORTED_MODELS)
            is first verified on a reduced random-weight copy of its config (kvrewrite.verify: full vs HF per
            layer; a few seconds, once per config and process); a mismatch raises RewriteError with the
            report, a pass is logged at INFO. Tested types cost nothing extra. True: verify whatever the type.
            False: skip it; an untested type then logs a WARNING that its rewrite is untrusted.
        tp: tensor-parallel ranks (docs/tensor-parallel.md). With tp=N > 1, call apply on every rank of a
            `torchrun --nproc-per-node N` launch, each rank holding the whole model as loaded (without HF's
            tp_plan) or only its share (kvrewrite.tensor_parallel.rank_model's result): torch.distributed is
            initialised from torchrun's environment if it is not yet (NCCL on CUDA, gloo on the CPU), the rank
            keeps its share of the KV heads (GQA groups whole) and of the MLP, and its state holds only its heads.
            Every rank then calls rw.generate with the same inputs and gets the same tokens. Refused (naming the
            numbers) when N does not divide the KV heads, query heads or intermediate size, for model types
            outside kvrewrite.tensor_parallel.TP_MODELS, for the methods of TP_REFUSED_METHODS (none today), and with
            verify=True. tp=1 (default) is the single-device path, unchanged.
        tp_all_reduce: with tp > 1, how the ranks' partial sums are added (two per layer): "auto" (default) runs
            kvrewrite::tp_all_reduce, one kernel over symmetric memory, where it can (CUDA, NCCL, a torch with
            torch.ops.symm_mem), and the group's all-reduce elsewhere (a CUDA machine where its buffer cannot be
            set up, e.g. GPUs without peer access, raises naming "collective"); "one_shot" insists on the former
            (ValueError naming why it cannot run), "collective" takes the latter. rw.tp_all_reduce says which ran.
        **method_kwargs: the method's own options (see its class, e.g. ChelseaMethod).
    """
    from kvrewrite.capture import capture, check_causal_lm, model_tag
    from kvrewrite.rope import check_max_length, seq_len_dependent_ropes
    from kvrewrite.verification import auto_verify

    m = make_method(method, budget, **method_kwargs)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"kvrewrite.apply: batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 2:
        raise ValueError(f"kvrewrite.apply: prefill_chunk must be an int >= 2, got {prefill_chunk!r}")
    for flag, value in (("fuse_projections", fuse_projections), ("gemv", gemv)):
        if not isinstance(value, bool):
            raise ValueError(f"kvrewrite.apply: {flag} must be True or False, got {value!r}")
    if not (isinstance(verify, bool) or (isinstance(verify, str) and verify == "auto")):
        raise ValueError(f"kvrewrite.apply: verify must be 'auto', True or False, got {verify!r}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"kvrewrite.apply: tp must be an int >= 1, got {tp!r}")
    check_causal_lm(model)  # before reading model.config
    tag = model_tag(model)
    if max_length is None:
        max_length = min(getattr(model.config, "max_position_embeddings", DEFAULT_MAX_LENGTH) or DEFAULT_MAX_LENGTH,
                         DEFAULT_MAX_LENGTH, *(limit for _, _, limit in seq_len_dependent_ropes(model)))
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"kvrewrite.apply: max_length must be an int >= 1, got {max_length!r}")
    check_max_length(model, max_length, tag)
    if tp > 1:
        from kvrewrite.tensor_parallel import check_tp_method

        check_tp_method(m, tp, verify, tag)
    if captured is None:
        if tp > 1:
            from kvrewrite.tensor_parallel import capture_rank

            captured = capture_rank(model, tp, batch_size=batch_size, prefill_chunk=prefill_chunk)
        else:
            captured = capture(model, batch_size=batch_size, prefill_chunk=prefill_chunk)
    if captured.tp != tp:
        raise ValueError(f"kvrewrite.apply: captured is a capture for tp={captured.tp}, but tp={tp}: capture "
                         f"with the same tp (kvrewrite.tensor_parallel.capture_rank for tp > 1)")
    from kvrewrite.tensor_parallel import prepare_all_reduce

    all_reduce = prepare_all_reduce(tp_all_reduce, tp, captured.tp_group, captured.device, f"kvrewrite.apply ({tag})")
    if tp == 1:
        auto_verify(model, captured, captured.prefill_chunk, verify)  # tp > 1: TP_MODELS are all tested types
    return _rewrite(model, m, captured, max_length, fuse_projections=fuse_projections, gemv=gemv,
                    tp_all_reduce=all_reduce)


def _rewrite(model, m, captured, max_length: int, fuse_projections: bool = False, gemv: bool = False,
             tp_all_reduce: str = "collective"):
    """The KVRewrittenModel of `captured` for method instance `m` (apply's last step; verify's too)."""
    from kvrewrite.context import RewriteContext
    from kvrewrite.passes import TP_PASSES, run_passes
    from kvrewrite.capture import copy_graph_module
    from kvrewrite.runtime import KVRewrittenModel

    if hasattr(m, "bind"):
        m.bind(captured.layers)
    # Three rewritten graphs: prefill chunk, decode step, decode step with compression (run on the
    # steps where the runtime's host-side schedule knows some layer reaches its threshold).
    variants = {"prefill": ("prefill", True), "decode": ("decode", False), "decode_compress": ("decode", True)}
    graphs = {}
    for name, (kind, compress) in variants.items():
        ctx = RewriteContext(captured.model_tag, m, captured.layers, graph_kind=kind, compress=compress,
                             cache_buffers=captured.cache_buffers, fuse_projections=fuse_projections,
                             fused_weights=captured.fused_weights, gemv=gemv, max_length=max_length, tp=captured.tp,
                             tp_group=captured.tp_group, tp_row_parallel=captured.tp_row_parallel,
                             tp_vocab_parallel=captured.tp_vocab_parallel,
                             tp_rank=captured.tp_rank, tp_all_reduce=tp_all_reduce)
        graphs[name] = run_passes(copy_graph_module(captured.graphs[kind]), ctx,
                                  passes=TP_PASSES if captured.tp > 1 else None)
    rw = KVRewrittenModel(captured, graphs, m, max_length, config=model.config)
    rw.tp_all_reduce = tp_all_reduce
    rw.generation_config = model.generation_config
    return rw
