#!/usr/bin/python3
"""The CPU oracle for trainmem --task inference: one forward pass of a reference model in model.eval() under
torch.inference_mode() (run under torch.no_grad(), see measure_inference), with measure.py's storage registry counting the live tensor bytes after every op
(live.py). Compared with `trainmem timeline --task inference --steps 1 --by event --format json`: the peak and
the end of the forward (the logits, which the script keeps bound, included), exactly.

    /usr/bin/python3 validate/cpu/inference.py --trainmem build/trainmem

What differs from the training oracle: no saved_tensors_hooks (inference_mode records no graph), no labels
(the transformers models return their logits; nanoGPT's GPT.forward without targets runs lm_head on the last
position only), dropout off by model.eval() (the configs' probabilities are left as they are).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import live  # noqa: E402
import measure  # noqa: E402
import models  # noqa: E402

# (name, config, batch, seq, precision). Dropout probabilities are kept (non-zero ones too): eval() turns them off.
_LL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2}
_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128, "n_positions": 64,
         "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
_BERT = {"model_type": "bert", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 64}
GRID = [
    ("infer-llama-fp32", {"model_type": "llama", **_LL}, 2, 16, "fp32"),
    ("infer-llama-bf16", {"model_type": "llama", **_LL}, 3, 32, "bf16"),
    ("infer-qwen2-bf16-amp", {"model_type": "qwen2", **_LL}, 2, 16, "bf16-amp"),
    ("infer-gpt2-fp32", _GPT2, 2, 16, "fp32"),
    ("infer-gpt2-bf16", _GPT2, 1, 32, "bf16"),
    ("infer-nanogpt-fp32", {"model_type": "nanogpt", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128,
                            "block_size": 64, "bias": True, "dropout": 0.1}, 2, 32, "fp32"),
    ("infer-neox-fp32", {"model_type": "gpt_neox", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 256,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "rotary_pct": 0.25}, 2, 16, "fp32"),
    ("infer-gemma3-text-bf16", {"model_type": "gemma3_text", **_LL, "head_dim": 16, "sliding_window": 8,
                                "sliding_window_pattern": 2}, 2, 32, "bf16"),
    ("infer-phi-qkln-fp32", {"model_type": "phi", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 256,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "partial_rotary_factor": 0.5,
                             "qk_layernorm": True, "resid_pdrop": 0.1}, 2, 16, "fp32"),
    ("infer-opt-bf16", {"model_type": "opt", "vocab_size": 96, "hidden_size": 64, "ffn_dim": 128,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64}, 2, 16,
     "bf16"),
    # encoders: one forward of each head (BertFor*: architectures[0]), the tokenizer's three inputs
    ("infer-bert-mlm-fp32", {**_BERT, "architectures": ["BertForMaskedLM"]}, 2, 16, "fp32"),
    ("infer-bert-seqcls-bf16", {**_BERT, "architectures": ["BertForSequenceClassification"], "num_labels": 3}, 2,
     16, "bf16"),
    # (no autocast row: BERT's softmax has no dtype, and CPU autocast in torch 1.13 leaves it in bf16 where CUDA
    # autocast runs it in float32, as trainmem models)
    ("infer-bert-tokcls-fp32", {**_BERT, "architectures": ["BertForTokenClassification"]}, 3, 8, "fp32"),
    ("infer-llama-seqcls-fp32", {"model_type": "llama", **_LL, "architectures": ["LlamaForSequenceClassification"],
                                 "pad_token_id": 0, "num_labels": 3}, 2, 16, "fp32"),
    # RoBERTa: input_ids and attention_mask only; position ids from padding_idx + 1 (66 rows: 64 tokens)
    ("infer-roberta-mlm-fp32", {**_BERT, "model_type": "roberta", "max_position_embeddings": 66,
                                "architectures": ["RobertaForMaskedLM"]}, 2, 16, "fp32"),
    ("infer-roberta-seqcls-bf16", {**_BERT, "model_type": "roberta", "max_position_embeddings": 66,
                                   "architectures": ["RobertaForSequenceClassification"]}, 3, 8, "bf16"),
    # falcon: the layer returns its eager attention weights, held by FalconModel's `outputs` until the next block
    # returns; ALiBi's tensor and mask live for the whole forward
    ("infer-falcon-rw-alibi-fp32", {"model_type": "falcon", "vocab_size": 96, "hidden_size": 64,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "alibi": True, "bias": True,
                                    "multi_query": False, "parallel_attn": False}, 2, 16, "fp32"),
    ("infer-falcon-mq-bf16", {"model_type": "falcon", "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "tie_word_embeddings": False}, 2, 16, "bf16"),
    # mixture of experts: routers forced to trainmem's default assumption, balanced (models.set_moe_routing)
    ("infer-mixtral-bf16", {"model_type": "mixtral", **_LL, "num_local_experts": 4}, 2, 12, "bf16"),
    ("infer-qwen2_moe-fp32", {"model_type": "qwen2_moe", **_LL, "num_experts": 4, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 48, "shared_expert_intermediate_size": 96}, 2, 10, "fp32"),
    # experts_implementation="grouped_mm" (trainmem --moe-experts grouped_mm; models._GroupedMM for torch 1.13)
    ("infer-qwen3_moe-grouped_mm", {"model_type": "qwen3_moe", **_LL, "num_experts": 4, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 40, "head_dim": 16}, 2, 12, "bf16", "grouped_mm"),
    # DeepSeek-V3: latent attention, a dense first layer, then DeepseekV3MoE (sigmoid group-limited router)
    ("infer-deepseek_v3-bf16-amp", {"model_type": "deepseek_v3", **_LL, "num_key_value_heads": 4, "q_lora_rank": 24,
                                    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                                    "v_head_dim": 12, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
                                    "topk_group": 1, "moe_intermediate_size": 24, "first_k_dense_replace": 1}, 2, 12,
     "bf16-amp"),
    # rank 0 of transformers' tensor parallelism (tp_shard.py; trainmem --tp): (..., experts, tp)
    ("infer-tp2-llama-bf16", {"model_type": "llama", **_LL}, 2, 16, "bf16", "eager", 2),
    ("infer-tp4-llama-mha-fp32", {"model_type": "llama", **_LL, "num_key_value_heads": 4}, 2, 16, "fp32", "eager", 4),
]


def measure_inference(config, batch, seq, precision, seed=0, moe_experts="eager", tp=1):
    """One forward in eval() under inference_mode; returns live.build's timeline and the base bytes."""
    dtype, autocast_dtype = measure.PRECISIONS[precision]
    torch.manual_seed(seed)
    model = models.build_model(dict(config))
    models.set_moe_routing(model, batch * seq, "balanced")  # MoE routers: trainmem's default --moe-routing
    models.set_moe_experts(model, moe_experts)
    if tp > 1:
        measure.tp_shard.apply_tp(model, tp)  # rank 0 of transformers' tensor parallelism
    if dtype != torch.float32:
        model.to(dtype)
    model.eval()
    g = torch.Generator().manual_seed(seed + 1)
    if hasattr(model, "make_inputs"):  # an encoder: input_ids, token_type_ids, attention_mask (models.BertFor*)
        inputs = model.make_inputs(batch, seq, g, labels=False)
    else:
        inputs = [torch.randint(0, model.vocab_size, (batch, seq), dtype=torch.int64, generator=g)]
    params, buffers = list(model.parameters()), list(model.buffers())
    base_keys = {models.storage_id(t)[0] for t in params + buffers + inputs}
    registry = measure._StorageRegistry()
    # torch.no_grad() stands in for torch.inference_mode(): neither records a graph, and they allocate the same
    # tensors; under inference_mode the Autograd key is excluded, so a composite op (layer_norm, linear) reaches
    # the Python mode whole and its inner tensors (native_layer_norm's mean and rstd) would be invisible.
    with torch.no_grad():
        with registry:
            if autocast_dtype is not None:
                with torch.autocast("cpu", dtype=autocast_dtype):
                    out = model(*inputs)
            else:
                out = model(*inputs)
        registry.mark("end of forward")  # `outputs` (the logits) still bound, as the script keeps them
    tl = live.build(registry, base_keys, dict(registry.cuda_sizes), set(), set())
    base = measure._storage_bytes(params + buffers + inputs)
    del out
    return tl, base, measure._storage_bytes(params + buffers)


def run_trainmem(binary, path, model_type, batch, seq, precision, moe_experts="eager", tp=1):
    impl = "nanogpt" if model_type == "nanogpt" else "hf"
    cmd = [binary, "timeline", "--model", path, "--impl", impl, "--attention", "eager", "--batch", str(batch),
           "--seq", str(seq), "--precision", precision, "--task", "inference", "--steps", "1", "--by", "event",
           "--format", "json"]
    if moe_experts != "eager":
        cmd += ["--moe-experts", moe_experts]
    if tp > 1:
        cmd += ["--tp", str(tp)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()}")
    return json.loads(p.stdout)


def compare(tl, base, tm, weights_and_buffers):
    """(measured, trainmem) for the forward's peak and end, and the event-level differences (informational)."""
    _tm_base, tms = live.trainmem_segments(tm)
    o = live.oracle_segments(tl, base)["forward"]
    t = tms["forward"]
    osz, tsz = sorted(a[0] for a in o["allocs"]), sorted(a[0] for a in t["allocs"])
    return {"peak": (o["peak"], t["peak"]), "end": (o["end"], t["end"]), "same_tensors": osz == tsz,
            "base": (weights_and_buffers, _tm_base)}


def trainmem_argument(argv, doc):
    """The absolute path of --trainmem, the one argument of the oracle scripts."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainmem", required=True)
    return os.path.abspath(ap.parse_args(argv).trainmem)


def each_config(grid, prefix):
    """Each grid row (name, config, ...) with the path its config is written to, in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for row in grid:
            path = os.path.join(tmp, row[0] + ".json")
            with open(path, "w") as f:
                json.dump(row[1], f)
            yield row, path


def main(argv=None):
    binary = trainmem_argument(argv, __doc__)
    failures = 0
    for (name, cfg, batch, seq, prec, *rest), path in each_config(GRID, "trainmem-infer-"):
        experts = rest[0] if rest else "eager"  # a MoE row's experts_implementation
        tp = rest[1] if len(rest) > 1 else 1  # tensor-parallel ranks (rank 0 simulated)
        tl, base, pb = measure_inference(cfg, batch, seq, prec, moe_experts=experts, tp=tp)
        r = compare(tl, base, run_trainmem(binary, path, cfg["model_type"], batch, seq, prec, experts, tp), pb)
        ok = r["peak"][0] == r["peak"][1] and r["end"][0] == r["end"][1] and r["base"][0] == r["base"][1]
        failures += not ok
        print(f"{name:24s} B={batch} T={seq} {prec:8s} peak measured {r['peak'][0]:>10,} trainmem "
              f"{r['peak'][1]:>10,}   end {r['end'][0]:>10,} / {r['end'][1]:>10,}   "
              f"{'ok' if ok else 'FAIL'}{'' if r['same_tensors'] else ' (allocations differ: info)'}")
    print(f"{len(GRID)} inference configurations: {len(GRID) - failures} ok, {failures} failing")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
