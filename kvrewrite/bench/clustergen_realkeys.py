"""ClusterGen's fold on real keys: the default launch forms (DIST_DOT, RESOLVE_EVENTS, JOINER_INDEX) against the
direct form, field for field after every fold. DIST_DOT rounds otherwise than the direct form, so a near-tie may
decide otherwise; random normal keys are all near-ties (bench.clustergen_fold), real keys are what matter.

  python -m kvrewrite.bench.clustergen_realkeys dump OUT.pt [--models smollm2-135m,qwen2.5-0.5b]   (CPU: the models)
  python -m kvrewrite.bench.clustergen_realkeys check OUT.json IN.pt [IN.pt ...]                     (GPU: the kernels)

dump: the post-RoPE keys and values (HF's cache) of 2048 tokens of Shakespeare, every other layer, bf16 (~36 MB for
the two models). check: per layer, one row of each KV head, 7 chunks of 256 tokens folded at budget 0.2 (of 2048),
then 4 decode folds of 32, both forms from the same state; a fold whose states differ is counted and both go on from the
direct form's state. Stop 62 (H200, with RES_B 128): 0 of 297 folds differed (docs/bench.md "Stop 62 runs").
"""
import argparse
import json

import torch

from kvrewrite.bench.clustergen_fold import DIRECT, FIELDS, G, KW, T, empty

CHUNK, TOKENS = 256, 2048


def dump(out: str, models: list) -> None:
    from kvrewrite.assets import load_model, load_text

    text = load_text("shakespeare")
    kv = {}
    for name in models:
        model, tok = load_model(name, dtype=torch.float32)
        ids = tok(text[200000:400000], return_tensors="pt").input_ids[:, :TOKENS]
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
        kv[name] = {i: (cache.layers[i].keys[0].bfloat16().clone(), cache.layers[i].values[0].bfloat16().clone())
                    for i in range(0, len(cache.layers), 2)}
        print(name, len(kv[name]), "layers", tuple(kv[name][0][0].shape), flush=True)
    torch.save(kv, out)


def _state(H: int, D: int) -> dict:
    """A reset state of one row of H KV heads: budget 0.2 of TOKENS, room for a chunk."""
    Bt = round(0.2 * TOKENS)
    C = Bt + G - 1 + CHUNK
    return empty(1, Bt, C, -(-(C // 2) // T) + 1, H=H, D=D)


def check(out: str, paths: list) -> list:
    from kvrewrite.kernels import _clustergen_fold_kernels as kk

    kv = {}
    for path in paths:
        kv.update(torch.load(path))
    report = []
    for model, layers in kv.items():
        for layer, (k, v) in layers.items():
            H, _, D = k.shape
            direct, default = _state(H, D), _state(H, D)
            pos, folds, differ = 0, 0, []
            for n in [CHUNK] * ((TOKENS - 4 * G) // CHUNK) + [G] * 4:
                for s in (direct, default):
                    f = int(s["fill"][0, 0])
                    s["keys"][0, :, f:f + n] = k[:, pos:pos + n].cuda()
                    s["values"][0, :, f:f + n] = v[:, pos:pos + n].cuda()
                    s["slot_pos"][0, :, f:f + n] = torch.arange(pos, pos + n, device="cuda")
                    s["bias"][0, :, f:f + n] = 0.0
                    s["fill"] += n
                pos += n
                kk.triton_clustergen_fold(*(direct[f] for f in FIELDS), **dict(KW, layer=layer), **DIRECT)
                kk.triton_clustergen_fold(*(default[f] for f in FIELDS), **dict(KW, layer=layer))
                folds += 1
                fields = [f for f in FIELDS if not torch.equal(direct[f].nan_to_num(), default[f].nan_to_num())]
                if fields:
                    differ.append((folds, fields))
                    for f in FIELDS:
                        default[f].copy_(direct[f])
            row = dict(model=model, layer=layer, heads=H, D=D, folds=folds, clusters=int(direct["n_clusters"].sum()),
                       forced=int(direct["n_forced"].sum()), folds_that_differ=differ)
            report.append(row)
            print(json.dumps(row), flush=True)
    print("folds", sum(r["folds"] for r in report), "differing", sum(len(r["folds_that_differ"]) for r in report))
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="the models' keys and values (CPU)")
    d.add_argument("out")
    d.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    c = sub.add_parser("check", help="the two forms on the dumped keys (CUDA)")
    c.add_argument("out")
    c.add_argument("inputs", nargs="+")
    args = p.parse_args()
    if args.cmd == "dump":
        dump(args.out, args.models.split(","))
    else:
        if not torch.cuda.is_available():
            p.error("check runs the Triton kernels: it needs a CUDA device")
        check(args.out, args.inputs)


if __name__ == "__main__":
    main()
