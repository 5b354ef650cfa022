"""How many of the passphrase's tokens stay verbatim (degree-1 slots) after Chelsea's post-prefill compression
(depth 0.5; the one-hot values of the needle tokens are merged with the keys, so a slot's value says who is in it).

    PYTHONPATH=. python docs/results/diagnosis/needle_verbatim.py smollm2-135m 2048,4096
"""
import sys, json, time
import torch
from kvrewrite.assets import load_model, load_text
from kvrewrite.eval.needle import haystack, ANSWER, QUESTION
from kvrewrite.kernels.chelsea_compress import chelsea_rows
name = sys.argv[1]
model, tok = load_model(name); text = load_text("paul_graham")
res = {}
for n in [int(x) for x in sys.argv[2].split(",")]:
    context, _ = haystack(tok, text, n, 0.5)
    chat = tok.apply_chat_template([{"role": "user", "content": f"{context}\n\n{QUESTION}"}], tokenize=False, add_generation_prompt=True)
    enc = tok(chat, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor([enc["input_ids"]]); c0 = chat.index(ANSWER); c1 = c0 + len(ANSWER)
    span = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < c1 and b > c0]
    t = time.time()
    with torch.no_grad():
        pkv = model(ids, use_cache=True).past_key_values
    L = ids.shape[1]
    for budget in (0.2, 0.5):
        target = round(budget * (L + 24)); verb, degs = [], []
        for layer in pkv.layers:
            K = layer.keys[0].float(); H = K.shape[0]
            V = torch.zeros(H, L, K.shape[-1]); V[:, span, torch.arange(len(span))] = 1.0
            Ko, Vo, no, po = chelsea_rows(K, V, torch.ones(H, L), torch.arange(L).expand(H, -1).clone(), target, 16, 64, 256, .35, .1, 2, .1)
            for h in range(H):
                slot = Vo[h, :, :len(span)].argmax(0)  # slot holding each needle token
                d = no[h, slot]; degs += d.tolist(); verb += (d == 1).tolist()
        res[f"n={n} budget={budget}"] = {"prompt": L, "needle_tokens": len(span), "target": target,
                                          "verbatim_share": round(sum(verb) / len(verb), 3),
                                          "median_degree": float(torch.tensor(degs).median())}
        print(res, f"{time.time() - t:.0f}s", flush=True)
