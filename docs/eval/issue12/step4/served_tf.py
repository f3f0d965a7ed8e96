"""Served TF agreement (forced full-depth answers through the exit engine, batch 1) of the
shipped heads at several thresholds, 8 prompts per workload (as bench.shipped_exits)."""
import dataclasses
import json
import sys

sys.path.insert(0, ".")
from bench.common import exit_summary, serve
from bench.common import agreement, forced_params, make_llm
from bench.shipped_exits import split_agreement, workload_prompts
from ee_jax.models.loading import load_model
from ee_jax.serving.params import greedy

model = load_model("smollm2-135m-instruct", dtype="float32", progress=False)
ec, heads = model.shipped_exit_heads()
res = {}
for w in ("instructions", "humaneval", "chat"):
    prompts = workload_prompts(model, w, 8)
    full = make_llm(model, None, None, 1, 1024)
    refs = [o.token_ids for o in serve(full, prompts, greedy(64)).outputs]
    for thr in [float(t) for t in sys.argv[1:]]:
        e = dataclasses.replace(ec, threshold=thr)
        llm = make_llm(model, e, heads, 1, 1024)
        s = serve(llm, prompts, forced_params(refs))
        ex = exit_summary(s.stats, model.config, e)
        r = dict(agree=agreement(s.outputs, refs), split=split_agreement(s.outputs, refs, 30),
                 mean=ex["mean_layers"], ideal=ex["ideal"], hist=ex["row_hist"])
        res[f"{w}@{thr}"] = r
        print(w, thr, json.dumps(r), flush=True)
with open("runs/step4/served_tf.json", "w") as fh:
    json.dump(res, fh, indent=1)
