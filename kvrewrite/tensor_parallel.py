"""Tensor parallelism: the rank's share of a Hugging Face model, built before capture (docs/tensor-parallel.md).

`kvrewrite.apply(model, ..., tp=N)` runs on every rank of a `torchrun --nproc-per-node N` launch, each rank
holding the whole model as loaded. `rank_model` builds the rank's model from it:

    q_proj, k_proj, v_proj (+ biases)  rows of the rank's KV heads [r*Hkv/N, (r+1)*Hkv/N) and of their G query
                                       heads each (a GQA group never straddles two ranks)        column-parallel
    o_proj                             the same heads' input columns                             row-parallel
    gate_proj, up_proj                 rows [r*I/N, (r+1)*I/N)                                   column-parallel
    down_proj                          the same input columns                                    row-parallel
    lm_head (+ bias)                   rows [r*V/N, (r+1)*V/N) of the vocabulary, when N divides V  vocab-parallel
                                       and kernels/tp_all_gather.VOCAB_PARALLEL (on by default; off in stop 45)
    embedding, norms, q_norm/k_norm over head_dim (and an lm_head kept whole)                    replicated

and a config copy saying Hq/N, Hkv/N and I/N, so the capture, the layer facts and every method's state are sized
for the rank's heads. The row-parallel outputs are partial sums; passes/insert_tensor_parallel_all_reduce.py adds
the all-reduce after them: on CUDA kvrewrite::tp_all_reduce's one-shot kernel over symmetric memory, elsewhere the
group's all-reduce (apply's `tp_all_reduce`, prepare_all_reduce below). The vocab-parallel lm_head gives each rank
its slice of the logits; passes/insert_vocab_parallel_all_gather.py joins them (kvrewrite::tp_all_gather), so a
rank reads 1/N of the lm_head per decode step and every rank still holds the whole logits. A tied lm_head becomes
a row view of the (whole) input embedding on the rank's model. Every head is attended and compressed on
exactly one rank, by the same per-head code as with tp=1, so a method whose decisions are per KV head reproduces
tp=1 (ops that hash a head's index are told the rank's first head: `head_offset`); the rest would be refused
(TP_REFUSED_METHODS, empty today).

Memory: the rank model shares every replicated tensor with the user's model and the column-parallel slices are row
views of its weights (no copy); the row-parallel slices are column slices, copied once to be contiguous
(1/N of o_proj and of down_proj per layer). The user's model is left as it was: its modules, parameters and config are
untouched (the rank model has its own module objects and config).

Loading only the rank's share: `rank_model` works on a model built on the meta device too (no memory); the rank
materialises the result (`to_empty`), fills its weights and non-persistent buffers, and passes it to
`apply(..., tp=N)`, which recognises a rank model (its `kvrewrite_shard`) and captures it as it is. A 70B model
then never exists whole on one GPU (the bench does this for every tp > 1 run: bench/e2e.py, build_rank_model;
tensor_parallel_loading.load_rank_model does it from a safetensors checkpoint, reading only the rank's slices).
"""
import copy
import dataclasses
import itertools
import os

import torch
from torch import nn

from kvrewrite.errors import RewriteError

# Model types whose sharding the tensor-parallel test (tests/test_tensor_parallel.py) checks: the Llama layout
# (separate q/k/v/o and gate/up/down projections, attention that reshapes with -1 heads, per-head q/k norms at
# most). Any other type is refused rather than sharded by guess.
TP_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma", "gemma2", "granite", "smollm3",
                       "olmo", "cohere"})

# Methods whose tp>1 run would not reproduce tp=1, with the reason: apply refuses them at tp > 1 (check_tp_method).
# None today. clustergen and clusterkv were here until their ops took a `head_offset`: both draw random choices from a
# hash keyed by the KV head's index, a rank numbers its heads from 0, and insert_cache_compression now passes the
# rank's first head (tp_rank * Hkv) so that every head draws what it draws at tp=1 (tests/test_tensor_parallel.py).
TP_REFUSED_METHODS: dict = {}

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_HEAD_NORMS = ("q_norm", "k_norm")  # RMSNorm over head_dim (Qwen3, Gemma-3): the same on every head, replicated


@dataclasses.dataclass(frozen=True)
class RankShard:
    """What `rank_model` records on the rank's model (`kvrewrite_shard`): apply(tp=N) captures such a model as it
    is instead of sharding it again."""
    tp: int
    rank: int
    row_parallel: tuple  # names of its row-parallel weights (insert_tensor_parallel_all_reduce)
    slices: tuple = ()  # (parameter name, dim, start, stop): what each split tensor keeps (tensor_parallel_loading.py)
    vocab_parallel: str = ""  # the lm_head weight split by vocabulary rows (insert_vocab_parallel_all_gather), or ""
    tied_output: str = ""  # when that lm_head was tied: the input embedding weight its rows view, else ""


def check_tp_method(method, tp: int, verify, tag: str) -> None:
    """ValueError for a method refused under tp > 1 (TP_REFUSED_METHODS) and for verify=True (the reduced-copy
    verification runs one process's model; verify the tp=1 model instead)."""
    if method.name in TP_REFUSED_METHODS:
        raise ValueError(f"{tag}: method '{method.name}' is not supported with tp={tp}: "
                         f"{TP_REFUSED_METHODS[method.name]}; use tp=1")
    if verify is True:
        raise ValueError(f"{tag}: verify=True is not supported with tp={tp}: verify the model with tp=1 "
                         f"(kvrewrite.verify(model)), then apply it with tp={tp}")


def init_distributed(tp: int, device: torch.device, tag: str = "kvrewrite.apply"):
    """The default process group, initialised from torchrun's environment if it is not yet ("nccl" for a model
    on CUDA, "gloo" on the CPU); ValueError unless its world size is `tp`. Returns (rank, group name). `tag`: the
    caller the errors name (apply, or the export loader)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError(f"{tag}(tp={tp}): this torch build has no torch.distributed")
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"{tag}(tp={tp}): torch.distributed is not initialised and {missing} are not "
                               f"set: launch every rank with `torchrun --nproc-per-node {tp} ...` (or call "
                               f"torch.distributed.init_process_group first)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {}
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL and the functional collectives run on the current device
            kwargs["device_id"] = device
        dist.init_process_group(backend, **kwargs)
    world = dist.get_world_size()
    if world != tp:
        raise ValueError(f"{tag}: tp={tp} but the torch.distributed world size is {world}: launch "
                         f"`torchrun --nproc-per-node {tp}`" + (f" or pass tp={world}" if tag == "kvrewrite.apply"
                                                                 else ""))
    return dist.get_rank(), dist.group.WORLD.group_name


# apply's `tp_all_reduce`: how the row-parallel partial sums are added over the ranks (module docstring)
TP_ALL_REDUCES = ("auto", "one_shot", "collective")


def prepare_all_reduce(choice, tp: int, group_name: str, device: torch.device, tag: str) -> str:
    """The all-reduce of the rank's graphs for apply's `tp_all_reduce`: "collective" (the group's all-reduce, NCCL
    or gloo, as functional collectives in the graph) or "one_shot" (kvrewrite::tp_all_reduce: one kernel over
    symmetric memory on CUDA, its buffer prepared here: a collective, so every rank calls apply alike). "auto" takes
    the one-shot wherever it can run (CUDA, an NCCL group, a torch with symmetric memory) and says which it took
    in rw.tp_all_reduce; an explicit "one_shot" that cannot run is a ValueError with the reason, and a buffer that
    cannot be set up (GPUs without peer access, say) a RuntimeError naming tp_all_reduce="collective": never a silent
    switch, which could leave the ranks running different graphs."""
    from kvrewrite.kernels.tp_all_reduce import one_shot_unavailable, prepare

    if not isinstance(choice, str) or choice not in TP_ALL_REDUCES:
        raise ValueError(f"{tag}: tp_all_reduce must be one of {TP_ALL_REDUCES}, got {choice!r}")
    if tp == 1:
        if choice != "auto":
            raise ValueError(f"{tag}: tp_all_reduce={choice!r} needs tp > 1 (tp=1 sums nothing over ranks)")
        return "collective"
    if choice == "collective":
        return choice
    why = one_shot_unavailable(device, group_name)
    if why is not None:
        if choice == "one_shot":
            raise ValueError(f"{tag}: tp_all_reduce='one_shot' cannot run here: {why}; use tp_all_reduce="
                             f"'collective' (or 'auto', which picks it)")
        return "collective"
    try:
        prepare(group_name, device)
    except Exception as e:  # e.g. GPUs without peer access: name the way out instead of torch's internals
        raise RuntimeError(f"{tag}: tp_all_reduce={choice!r}: the symmetric-memory buffer of the one-shot all-reduce "
                           f"could not be set up on {device} ({type(e).__name__}: {e}); pass "
                           f"tp_all_reduce='collective' to sum with the group's all-reduce") from e
    return "one_shot"


def rank0_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` as rank 0 drew them, on every rank (a broadcast on the default group, which init_distributed starts
    and the all-reduces use): sampling draws from each rank's own generator, and ranks that fed different tokens
    would no longer compute the same model. Greedy picks need none: every rank holds the same logits."""
    import torch.distributed as dist

    dist.broadcast(tokens, src=0)
    return tokens


def refuse_hf_tensor_parallel(model, tag: str) -> None:
    """RewriteError for a model HF already sharded (`from_pretrained(..., tp_plan="auto")`): its weights are
    DTensors or local shards with HF's own collectives in hooks, which the capture cannot see as a whole model;
    kvrewrite's sharding lives in the rewrite (the rank's heads decide the state and the method's work)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed: init_distributed names it
        DTensor = ()
    hf_tp = (getattr(model, "_tp_size", None) or 1) > 1 or getattr(model, "_device_mesh", None) is not None
    if hf_tp or (DTensor and any(isinstance(p, DTensor) for p in model.parameters())):
        raise RewriteError(f"{tag}: the model is already tensor-parallel (loaded with tp_plan=...): load it "
                           f"without tp_plan on every rank and pass tp=N to kvrewrite.apply, which shards it itself")


def _decoder_layers(model, tag: str):
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise RewriteError(f"{tag}: tensor parallelism needs the decoder layers at model.model.layers; "
                           f"{type(model).__name__} has none")
    return layers


def _check_layout(layer, i: int, cfg, tag: str) -> tuple:
    """(Hq, Hkv, D, I) of decoder layer i; RewriteError for anything the sharding does not handle."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        raise RewriteError(f"{tag}: layer {i}: tensor parallelism needs self_attn and mlp modules")
    for mod, names, where in ((attn, _ATTN, "self_attn"), (mlp, _MLP, "mlp")):
        for n in names:
            if not isinstance(getattr(mod, n, None), nn.Linear):
                raise RewriteError(f"{tag}: layer {i}: {where}.{n} is not an nn.Linear: tensor parallelism handles "
                                   f"separate {'/'.join(names)} projections only (a fused one is not split yet)")
        allowed = set(names) | (set(_HEAD_NORMS) if where == "self_attn" else set())
        for n, child in mod.named_children():
            if n not in allowed and any(True for _ in child.parameters()):
                raise RewriteError(f"{tag}: layer {i}: {where}.{n} holds weights the tensor-parallel sharding does "
                                   f"not know how to split")
    D = attn.head_dim
    Hq, Hkv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if attn.q_proj.out_features != Hq * D or attn.k_proj.out_features != Hkv * D or \
            attn.v_proj.out_features != Hkv * D or attn.o_proj.in_features != Hq * D:
        raise RewriteError(f"{tag}: layer {i}: q/k/v/o shapes do not match Hq={Hq}, Hkv={Hkv}, head_dim={D}")
    for n in _HEAD_NORMS:
        norm = getattr(attn, n, None)
        if norm is not None and any(p.numel() != D for p in norm.parameters()):
            raise RewriteError(f"{tag}: layer {i}: self_attn.{n} normalises over more than one head (weights not of "
                               f"head_dim={D}): it cannot be split by head")
    I = mlp.gate_proj.out_features
    if mlp.up_proj.out_features != I or mlp.down_proj.in_features != I:
        raise RewriteError(f"{tag}: layer {i}: gate/up/down shapes do not agree on the intermediate size")
    return Hq, Hkv, D, I


def check_shardable(model, tp: int, tag: str) -> list:
    """[(Hq, Hkv, D, I)] per layer; RewriteError/ValueError naming the model type and the number when `model`
    cannot be split over `tp` ranks."""
    from kvrewrite.capture import refuse_alibi, text_config

    refuse_hf_tensor_parallel(model, tag)
    cfg = text_config(model)
    if cfg.model_type not in TP_MODELS:
        raise RewriteError(f"{tag}: tp={tp} is not supported for model type '{cfg.model_type}' yet (tensor "
                           f"parallelism covers {sorted(TP_MODELS)}): use tp=1")
    refuse_alibi(model, tag)
    shapes = [_check_layout(layer, i, cfg, tag) for i, layer in enumerate(_decoder_layers(model, tag))]
    if len(set(shapes)) != 1:
        raise RewriteError(f"{tag}: layers differ in heads, head_dim or intermediate size {sorted(set(shapes))}: "
                           f"tensor parallelism handles uniform layers only")
    Hq, Hkv, _, I = shapes[0]
    for name, value in (("num_key_value_heads", Hkv), ("num_attention_heads", Hq), ("intermediate_size", I)):
        if value % tp:
            raise ValueError(f"{tag}: tp={tp} does not divide {name}={value} of {cfg.model_type}")
    return shapes


def _param(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=like.requires_grad)


@torch.no_grad()
def _split_linear(lin: nn.Linear, a: int, z: int, rows: bool, name: str, slices: list) -> None:
    """Keep output rows [a, z) (column-parallel: a view, no copy) or input columns [a, z) (row-parallel: a
    contiguous copy; the bias stays whole, added once after the all-reduce); record each slice in `slices` as
    (parameter name, dim, a, z), `name` being the module's."""
    if rows:
        lin.weight = _param(lin.weight[a:z], lin.weight)
        slices.append((f"{name}.weight", 0, a, z))
        if lin.bias is not None:
            lin.bias = _param(lin.bias[a:z], lin.bias)
            slices.append((f"{name}.bias", 0, a, z))
        lin.out_features = z - a
    else:
        lin.weight = _param(lin.weight[:, a:z].contiguous(), lin.weight)
        slices.append((f"{name}.weight", 1, a, z))
        lin.in_features = z - a


def splits_lm_head(lm, tp: int) -> bool:
    """Whether a split over tp ranks splits this output embedding by vocabulary rows: tp > 1, kernels/tp_all_gather.
    VOCAB_PARALLEL, an nn.Linear, rows tp divides. The one rule _split_lm_head and the bench's byte count
    (bench.e2e.split_weight_bytes) both follow."""
    from kvrewrite.kernels import tp_all_gather

    return tp > 1 and tp_all_gather.VOCAB_PARALLEL and isinstance(lm, nn.Linear) and lm.out_features % tp == 0


def _split_lm_head(shard, tp: int, rank: int, slices: list) -> tuple:
    """Keep the rank's vocabulary rows of the output embedding when splits_lm_head (a row view: no copy; a tied one
    then views the input embedding's rows); returns (its weight's name, the input embedding weight's name if the two
    were tied), ("", "") when it stays whole."""
    lm = shard.get_output_embeddings()
    if not splits_lm_head(lm, tp):
        return "", ""
    names = {id(m): n for n, m in shard.named_modules()}
    emb = shard.get_input_embeddings()
    tied = f"{names[id(emb)]}.weight" if emb is not None and lm.weight is getattr(emb, "weight", None) else ""
    V = lm.out_features
    _split_linear(lm, rank * V // tp, (rank + 1) * V // tp, True, names[id(lm)], slices)
    return f"{names[id(lm)]}.weight", tied


def rank_model(model, tp: int, rank: int, tag: str):
    """The rank's model built from `model` (module docstring), marked with its `kvrewrite_shard` (RankShard: tp,
    rank and the names of its row-parallel weights).

    The copy shares every tensor of `model` (a deepcopy whose memo maps each parameter and buffer to itself),
    then its q/k/v/o and gate/up/down (and its lm_head, when tp divides its rows) get new parameters holding the
    rank's slices, and its config the rank's head and intermediate counts.
    """
    from kvrewrite.capture import text_config

    shapes = check_shardable(model, tp, tag)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise ValueError(f"{tag}: rank must be an int in [0, {tp}) for tp={tp}, got {rank!r}")
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    shard = copy.deepcopy(model, memo)
    row_parallel, slices = [], []
    for i, layer in enumerate(_decoder_layers(shard, tag)):
        Hq, Hkv, D, I = shapes[i]
        hk, G = Hkv // tp, Hq // Hkv
        attn, mlp = layer.self_attn, layer.mlp
        kv = (rank * hk * D, (rank + 1) * hk * D)
        q = (rank * hk * G * D, (rank + 1) * hk * G * D)
        inter = (rank * I // tp, (rank + 1) * I // tp)
        at, ml = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        _split_linear(attn.q_proj, *q, True, f"{at}.q_proj", slices)
        _split_linear(attn.k_proj, *kv, True, f"{at}.k_proj", slices)
        _split_linear(attn.v_proj, *kv, True, f"{at}.v_proj", slices)
        _split_linear(attn.o_proj, *q, False, f"{at}.o_proj", slices)
        _split_linear(mlp.gate_proj, *inter, True, f"{ml}.gate_proj", slices)
        _split_linear(mlp.up_proj, *inter, True, f"{ml}.up_proj", slices)
        _split_linear(mlp.down_proj, *inter, False, f"{ml}.down_proj", slices)
        row_parallel += [f"{at}.o_proj.weight", f"{ml}.down_proj.weight"]
    vocab, tied = _split_lm_head(shard, tp, rank, slices)
    cfg = text_config(shard)
    Hq, Hkv, D, I = shapes[0]
    cfg.head_dim = D  # explicit: some configs derive it from hidden_size // num_attention_heads
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size = Hq // tp, Hkv // tp, I // tp
    shard.kvrewrite_shard = RankShard(tp, rank, tuple(row_parallel), tuple(slices), vocab, tied)
    return shard


def capture_rank(model, tp: int, *, batch_size: int, prefill_chunk: int):
    """The rank's Captured of `model` (the whole HF model on every rank, or the rank's own model that `rank_model`
    made): torch.distributed initialised (init_distributed), the rank's model built (rank_model) and captured, the
    group and the row-parallel weights recorded for insert_tensor_parallel_all_reduce."""
    from kvrewrite.capture import capture, model_tag

    tag = model_tag(model)
    marked = getattr(model, "kvrewrite_shard", None)
    if marked is None:
        check_shardable(model, tp, tag)  # refusals before anything distributed starts
    elif marked.tp != tp:
        raise ValueError(f"{tag}: the model is rank {marked.rank}'s share of a tp={marked.tp} split, but tp={tp}")
    else:
        meta = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
        if meta:
            raise ValueError(f"{tag}: the rank's model still has {len(meta)} tensors on the meta device "
                             f"(first: {meta[0]}): materialise it (to_empty) and fill its weights and buffers first")
    rank, group = init_distributed(tp, model.device)
    shard = rank_model(model, tp, rank, tag) if marked is None else model
    if shard.kvrewrite_shard.rank != rank:
        raise ValueError(f"{tag}: the model is rank {shard.kvrewrite_shard.rank}'s share, but this process is "
                         f"rank {rank}")
    captured = capture(shard, batch_size=batch_size, prefill_chunk=prefill_chunk)
    captured.tp, captured.tp_rank, captured.tp_group = tp, rank, group
    captured.tp_row_parallel = shard.kvrewrite_shard.row_parallel
    captured.tp_vocab_parallel = shard.kvrewrite_shard.vocab_parallel
    return captured
