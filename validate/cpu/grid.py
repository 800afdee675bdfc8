#!/usr/bin/python3
"""Check trainmem against real PyTorch training steps on CPU, over a grid of small configurations.

    /usr/bin/python3 validate/cpu/grid.py --trainmem build/trainmem [--out report.json] [--only SUBSTR]
                                          [--compare-raw] [--list]

For each configuration: write its config.json to a temp dir, run one training step in-process
(measure.measure), run `trainmem estimate ... --format json`, and compare

  parameters              parameters.count                   == measured parameters           (exact)
  gradients_bytes         memory.gradients_bytes             == measured gradients_bytes      (exact)
  optimizer_state_bytes   memory.optimizer_state_bytes
                          - memory.optimizer_steps_bytes     == measured optimizer_state_bytes (exact; AdamW
                                                                step scalars are CPU tensors here, excluded on
                                                                both sides)
  saved_activations_bytes memory.saved_activations_bytes     within 0.5% of measured saved_activation_bytes_cuda
                                                                (--compare-raw: saved_activation_bytes, the CPU
                                                                torch 1.13 figure)

  trainable_parameters    parameters.trainable               == measured trainable_parameters (exact)

A comparison whose trainmem field is absent is reported as "missing" and is not a failure. weights_bytes and
buffers_bytes are shown for information. Exit status 1 if any available comparison fails or trainmem fails.

Configurations with options (frozen parameters, gradient checkpointing) pass trainmem --freeze GLOB,
--checkpointing full, --checkpoint-reentrant true|false and --checkpoint-every N, and compare saved activations
exactly (0 tolerance). While trainmem rejects those flags (exit 2, its CLI parser naming the flag as not
expected), such a configuration is reported as "pending: trainmem does not support --FLAG yet" and is not a
failure; once trainmem accepts the flags, any mismatch fails.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure  # noqa: E402
import live as live_timeline  # noqa: E402

SAVED_TOLERANCE = 0.005  # 0.5 %

# Shared shapes for the Llama family (small: C=64, F=160, V=96).
_LL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "attention_dropout": 0.0}


def _ll(model_type, **kw):
    c = {"model_type": model_type, **_LL}
    c.update(kw)
    return c


# DeepSeek-V3 (small: C=64, 4 heads, qk 16+8, v 12, q/kv ranks 24/16, 4 experts of 24 in 2 groups, top-2).
_DS = {"model_type": "deepseek_v3", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 160,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24,
       "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 4,
       "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 24, "n_shared_experts": 1,
       "first_k_dense_replace": 1, "attention_dropout": 0.0}


def _ds(**kw):
    c = dict(_DS)
    c.update(kw)
    return c


# Phi (small: C=64, F=256, V=96, 4 heads); every dropout key at 0.0.
_PHI = {"model_type": "phi", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "partial_rotary_factor": 0.5, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attention_dropout": 0.0}


def _bert(arch, **kw):
    cfg = {"model_type": "bert", "architectures": [arch], "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 64, "type_vocab_size": 2,
           "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    cfg.update(kw)
    return cfg


def _roberta(arch, **kw):
    # max_position_embeddings 66: pad_token_id 1 takes rows 0-1, so 64 tokens fit (create_position_ids_from_input_ids)
    cfg = {"model_type": "roberta", "architectures": [arch], "vocab_size": 96, "hidden_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 66,
           "type_vocab_size": 1, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    cfg.update(kw)
    return cfg


def _falcon(**kw):
    # tiny FalconConfig: C 64, 2 layers, V 96, 4 heads (multi_query by default), dropout keys at 0.0
    return {"model_type": "falcon", "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "attention_dropout": 0.0, "hidden_dropout": 0.0, **kw}


def _phi(**kw):
    c = dict(_PHI)
    c.update(kw)
    return c


# (name, config, batch, seq, precision[, options]). Every dropout probability is written as 0 into the config
# files. options: {"freeze": [globs], "checkpointing": "full", "reentrant": bool, "every": N,
# "lora": "r=..,alpha=..,dropout=..,targets=a+b" (trainmem's --lora spelling, passed to both sides),
# "lora_dtype": "fp32"|"base", "input_require_grads": bool}. precision "bf16-amp": float32 weights under bf16
# autocast (CPU autocast; CUDA-faithful for the Llama family, GPT-NeoX and OPT, see README).
def _t5(**kw):
    """A tiny T5 (T5Config keys): d_kv * num_heads need not be d_model."""
    cfg = {"model_type": "t5", "vocab_size": 96, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
           "num_heads": 4, "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16,
           "feed_forward_proj": "relu", "dropout_rate": 0.0}
    cfg.update(kw)
    return cfg


GRID = [
    # --- mlp stacks (trainmem --impl stack)
    ("mlp-linear256x250", {"model_type": "mlp", "input": 256, "layers": [{"linear": 250, "bias": True}]},
     4, 8, "fp32"),
    ("mlp-200-100-200-sigmoid", {"model_type": "mlp", "input": 200,
                                 "layers": [{"linear": 100}, "relu", {"linear": 200}, "sigmoid"]}, 3, 8, "fp32"),
    ("mlp-mixed-bf16", {"model_type": "mlp", "input": 96,
                        "layers": [{"linear": 128, "bias": False}, "gelu", "layer_norm", {"linear": 32}, "relu"]},
     2, 8, "bf16"),
    # --- nanoGPT
    ("nanogpt-bias-L2", {"model_type": "nanogpt", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128,
                         "block_size": 64, "bias": True, "dropout": 0.0}, 2, 32, "fp32"),
    ("nanogpt-nobias-bf16", {"model_type": "nanogpt", "n_layer": 1, "n_head": 2, "n_embd": 48, "vocab_size": 100,
                             "block_size": 128, "bias": False, "dropout": 0.0}, 3, 128, "bf16"),
    ("nanogpt-L3-T8", {"model_type": "nanogpt", "n_layer": 3, "n_head": 3, "n_embd": 96, "vocab_size": 256,
                       "block_size": 32, "bias": True, "dropout": 0.0}, 4, 8, "fp32"),
    ("nanogpt-nobias-B1", {"model_type": "nanogpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 64,
                           "block_size": 16, "bias": False, "dropout": 0.0}, 1, 16, "fp32"),
    # --- GPT-2
    ("gpt2-tied", {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128,
                   "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}, 2, 16, "fp32"),
    ("gpt2-untied-bf16", {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "vocab_size": 96,
                          "n_positions": 64, "n_inner": 96, "tie_word_embeddings": False, "resid_pdrop": 0.0,
                          "embd_pdrop": 0.0, "attn_pdrop": 0.0}, 1, 32, "bf16"),
    ("gpt2-gelu-B3", {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 48, "vocab_size": 80,
                      "n_positions": 32, "activation_function": "gelu", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                      "attn_pdrop": 0.0}, 3, 24, "bf16"),
    # --- Llama family
    ("llama-gqa-hd24", _ll("llama", head_dim=24), 2, 16, "fp32"),
    ("llama-gqa-hd24-bf16", _ll("llama", head_dim=24), 1, 64, "bf16"),
    ("llama-bias-tied", _ll("llama", num_key_value_heads=4, attention_bias=True, mlp_bias=True,
                            tie_word_embeddings=True), 2, 8, "fp32"),
    ("llama-B4-T128", _ll("llama", num_hidden_layers=1), 4, 128, "fp32"),
    ("qwen2-bias-gqa-bf16", _ll("qwen2", tie_word_embeddings=True), 2, 32, "bf16"),
    ("qwen2-B4", _ll("qwen2", num_key_value_heads=1), 4, 8, "fp32"),
    ("qwen3-hd128", _ll("qwen3", num_attention_heads=2, num_key_value_heads=1, head_dim=128), 1, 16, "fp32"),
    ("qwen3-qknorm-bf16", _ll("qwen3", head_dim=32, tie_word_embeddings=True), 2, 32, "bf16"),
    ("gemma", _ll("gemma", num_key_value_heads=1, head_dim=32, hidden_act="gelu_pytorch_tanh"), 2, 16, "fp32"),
    ("gemma-bf16", _ll("gemma", num_key_value_heads=1, head_dim=32), 3, 16, "bf16"),
    ("gemma2", _ll("gemma2", head_dim=32, sliding_window=8, query_pre_attn_scalar=32), 2, 16, "fp32"),
    ("gemma2-bf16", _ll("gemma2", head_dim=16, sliding_window=8), 1, 32, "bf16"),
    ("phi3-partial0.5", _ll("phi3", num_key_value_heads=4, partial_rotary_factor=0.5, resid_pdrop=0.0,
                            embd_pdrop=0.0), 2, 16, "fp32"),
    ("phi3-gqa-bf16", _ll("phi3", partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0), 2, 24, "bf16"),
    ("gemma3-text-sliding-full", _ll("gemma3_text", num_hidden_layers=3, head_dim=32, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
     2, 16, "fp32"),
    ("gemma3-text-bf16-softcap", _ll("gemma3_text", head_dim=16, sliding_window=8, sliding_window_pattern=2,
                                     final_logit_softcapping=30.0, attn_logit_softcapping=50.0), 1, 32, "bf16"),
    ("gemma3-text-untied-mqa", _ll("gemma3_text", num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
                                   query_pre_attn_scalar=32), 3, 8, "fp32"),
    ("starcoder2-gqa-bias", _ll("starcoder2", sliding_window=8, residual_dropout=0.0, embedding_dropout=0.0),
     2, 16, "fp32"),
    ("starcoder2-nobias-untied-bf16", _ll("starcoder2", use_bias=False, tie_word_embeddings=False,
                                          residual_dropout=0.0, embedding_dropout=0.0), 2, 32, "bf16"),
    ("mistral-sliding", _ll("mistral", sliding_window=8), 2, 16, "fp32"),
    ("mistral-bf16", _ll("mistral"), 4, 16, "bf16"),
    # --- Mixtral (5.x fused experts, eager loop); routing forced to trainmem's --moe-routing (models.set_moe_routing)
    ("mixtral-top2-balanced", _ll("mixtral", num_local_experts=3, num_experts_per_tok=2), 2, 11, "fp32",
     {"moe_routing": "balanced"}),
    ("mixtral-top2-worst-bf16", _ll("mixtral", num_local_experts=4, num_experts_per_tok=2), 2, 16, "bf16",
     {"moe_routing": "worst"}),
    ("mixtral-top1-balanced-bf16", _ll("mixtral", num_local_experts=4, num_experts_per_tok=1), 1, 18, "bf16",
     {"moe_routing": "balanced"}),
    ("mixtral-top1-worst", _ll("mixtral", num_local_experts=4, num_experts_per_tok=1, num_hidden_layers=1), 2, 8,
     "fp32", {"moe_routing": "worst"}),
    ("mixtral-top2-balanced-bf16-amp", _ll("mixtral", num_local_experts=4, num_experts_per_tok=2), 2, 12, "bf16-amp",
     {"moe_routing": "balanced"}),
    ("lora-mixtral-all-linear-bf16", _ll("mixtral", num_local_experts=4, num_experts_per_tok=2), 2, 8, "bf16",
     {"moe_routing": "balanced", "lora": "r=4,alpha=8,targets=all-linear"}),
    ("lora-qwen2_moe-all-linear-ckpt", _ll("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                           shared_expert_intermediate_size=96), 2, 8, "fp32",
     {"moe_routing": "worst", "lora": "r=4,alpha=8,targets=all-linear", "checkpointing": "full", "reentrant": True,
      "input_require_grads": True}),
    ("ckpt-mixtral-reentrant-bf16", _ll("mixtral", num_local_experts=3, num_experts_per_tok=2), 2, 8, "bf16",
     {"moe_routing": "balanced", "checkpointing": "full", "reentrant": True}),
    # experts_implementation="grouped_mm" (transformers 5.x's default), torch._grouped_mm emulated (models._GroupedMM)
    ("mixtral-grouped_mm-top2", _ll("mixtral", num_local_experts=3, num_experts_per_tok=2), 2, 11, "fp32",
     {"moe_routing": "balanced", "moe_experts": "grouped_mm"}),
    ("mixtral-grouped_mm-top1-worst-bf16", _ll("mixtral", num_local_experts=4, num_experts_per_tok=1), 2, 8, "bf16",
     {"moe_routing": "worst", "moe_experts": "grouped_mm"}),
    ("qwen2_moe-grouped_mm-bf16", _ll("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                      shared_expert_intermediate_size=96, norm_topk_prob=True), 2, 8, "bf16",
     {"moe_routing": "balanced", "moe_experts": "grouped_mm"}),
    ("lora-qwen3_moe-grouped_mm-bf16", _ll("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40),
     2, 8, "bf16", {"moe_routing": "balanced", "moe_experts": "grouped_mm", "lora": "r=4,alpha=8,targets=q_proj+v_proj"}),
    ("qwen2_moe-shared-bf16-amp", _ll("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                      shared_expert_intermediate_size=96), 2, 8, "bf16-amp", {"moe_routing": "worst"}),
    # --- Qwen2-MoE (shared expert with a sigmoid gate, dense layers by decoder_sparse_step / mlp_only_layers) and
    # Qwen3-MoE (q/k norms, experts registered before the router)
    ("qwen2_moe-shared-sparse2", _ll("qwen2_moe", num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                     decoder_sparse_step=2), 2, 12, "fp32", {"moe_routing": "balanced"}),
    ("qwen2_moe-norm-topk-bf16", _ll("qwen2_moe", num_experts=5, num_experts_per_tok=3, moe_intermediate_size=32,
                                     shared_expert_intermediate_size=64, norm_topk_prob=True, qkv_bias=False,
                                     mlp_only_layers=[0]), 2, 10, "bf16", {"moe_routing": "worst"}),
    ("qwen3_moe-top1-worst", _ll("qwen3_moe", head_dim=32, num_experts=4, num_experts_per_tok=1,
                                 moe_intermediate_size=40), 2, 8, "fp32", {"moe_routing": "worst"}),
    ("qwen3_moe-normtopk-bf16", _ll("qwen3_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                                    norm_topk_prob=True), 1, 20, "bf16", {"moe_routing": "balanced"}),
    # --- DeepSeek-V3 (latent attention; DeepseekV3MoE: sigmoid group-limited router, the 3-D experts' eager loop,
    # ungated shared experts, dense layers before first_k_dense_replace); routing forced as for Mixtral
    ("deepseek_v3-qlora-dense1-balanced", _ds(), 2, 9, "fp32", {"moe_routing": "balanced"}),
    ("deepseek_v3-qproj-worst-bf16", _ds(q_lora_rank=None, rope_interleave=False, n_shared_experts=2), 2, 8, "bf16",
     {"moe_routing": "worst"}),
    ("deepseek_v3-bias-worst", _ds(attention_bias=True, norm_topk_prob=False, first_k_dense_replace=0,
                                   num_experts_per_tok=3, n_routed_experts=6, n_group=3, topk_group=2), 1, 12, "fp32",
     {"moe_routing": "worst"}),
    ("deepseek_v3-balanced-bf16", _ds(num_hidden_layers=3), 2, 10, "bf16", {"moe_routing": "balanced"}),
    ("deepseek_v3-bf16-amp", _ds(), 2, 8, "bf16-amp", {"moe_routing": "balanced"}),
    ("deepseek_v3-grouped_mm", _ds(q_lora_rank=None), 2, 8, "fp32",
     {"moe_routing": "balanced", "moe_experts": "grouped_mm"}),
    ("ckpt-deepseek_v3-reentrant-bf16", _ds(), 2, 8, "bf16",
     {"moe_routing": "balanced", "checkpointing": "full", "reentrant": True}),
    ("lora-deepseek_v3-all-linear-ckpt", _ds(), 2, 8, "bf16",
     {"moe_routing": "worst", "lora": "r=4,alpha=8,targets=all-linear", "checkpointing": "full", "reentrant": True}),
    # --- GPT-NeoX
    ("neox-parallel-rot0.25", {"model_type": "gpt_neox", "vocab_size": 96, "hidden_size": 64,
                               "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "rotary_pct": 0.25, "use_parallel_residual": True, "attention_dropout": 0.0,
                               "hidden_dropout": 0.0}, 2, 16, "fp32"),
    ("neox-sequential-bf16", {"model_type": "gpt_neox", "vocab_size": 96, "hidden_size": 64,
                              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                              "rotary_pct": 0.25, "use_parallel_residual": False, "attention_dropout": 0.0,
                              "hidden_dropout": 0.0}, 2, 32, "bf16"),
    ("neox-tied-nobias", {"model_type": "gpt_neox", "vocab_size": 64, "hidden_size": 48,
                          "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
                          "rotary_pct": 0.5, "attention_bias": False, "tie_word_embeddings": True,
                          "attention_dropout": 0.0, "hidden_dropout": 0.0}, 3, 8, "fp32"),
    # --- Phi
    ("phi-partial0.5", _phi(), 2, 16, "fp32"),
    ("phi-qkln-gqa-rot0.4-bf16", _phi(num_key_value_heads=2, partial_rotary_factor=0.4, qk_layernorm=True),
     2, 32, "bf16"),
    ("phi-qkln-B1", _phi(num_hidden_layers=1, qk_layernorm=True), 1, 16, "fp32"),
    ("phi-tied-rot1.0-gelu", _phi(hidden_size=48, intermediate_size=96, partial_rotary_factor=1.0,
                                  tie_word_embeddings=True, hidden_act="gelu"), 3, 8, "fp32"),
    # --- OPT
    ("opt-prenorm", {"model_type": "opt", "vocab_size": 96, "hidden_size": 64, "ffn_dim": 256,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
                     "do_layer_norm_before": True, "dropout": 0.0, "attention_dropout": 0.0,
                     "activation_dropout": 0.0}, 2, 16, "fp32"),
    ("opt-postnorm-proj-bf16", {"model_type": "opt", "vocab_size": 96, "hidden_size": 64, "ffn_dim": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
                                "do_layer_norm_before": False, "word_embed_proj_dim": 48, "dropout": 0.0,
                                "attention_dropout": 0.0, "activation_dropout": 0.0}, 2, 32, "bf16"),
    ("opt-prenorm-proj-untied-nobias", {"model_type": "opt", "vocab_size": 80, "hidden_size": 32, "ffn_dim": 64,
                                        "num_hidden_layers": 1, "num_attention_heads": 2,
                                        "max_position_embeddings": 32, "word_embed_proj_dim": 24,
                                        "enable_bias": False, "tie_word_embeddings": False, "dropout": 0.0,
                                        "attention_dropout": 0.0, "activation_dropout": 0.0}, 1, 8, "fp32"),
    # --- BERT (architectures[0] picks the head; every dropout key at 0.0, classifier_dropout None follows them)
    ("bert-mlm", _bert("BertForMaskedLM"), 2, 16, "fp32"),
    ("bert-mlm-bf16", _bert("BertForMaskedLM", hidden_act="gelu_new"), 2, 32, "bf16"),
    ("bert-seqcls3", _bert("BertForSequenceClassification", num_labels=3), 3, 8, "fp32"),
    ("bert-seqcls-id2label-bf16", _bert("BertForSequenceClassification", id2label={"0": "a", "1": "b"},
                                        type_vocab_size=1), 2, 16, "bf16"),
    ("bert-tokcls5", _bert("BertForTokenClassification", num_labels=5, num_hidden_layers=1), 2, 16, "fp32"),
    ("bert-tokcls-bf16", _bert("BertForTokenClassification", num_labels=4), 1, 24, "bf16"),
    # --- decoders with GenericForSequenceClassification (score, last non-pad token; pad_token_id given)
    ("llama-seqcls", _ll("llama", architectures=["LlamaForSequenceClassification"], pad_token_id=0), 2, 16, "fp32"),
    ("llama-seqcls3-bf16", _ll("llama", architectures=["LlamaForSequenceClassification"], pad_token_id=0,
                               num_labels=3), 3, 24, "bf16"),
    ("qwen2-seqcls5", _ll("qwen2", architectures=["Qwen2ForSequenceClassification"], pad_token_id=1, num_labels=5),
     2, 16, "fp32"),
    ("mistral-seqcls-bf16", _ll("mistral", architectures=["MistralForSequenceClassification"], pad_token_id=2,
                                id2label={"0": "a", "1": "b", "2": "c", "3": "d"}), 2, 32, "bf16"),
    # --- RoBERTa (no token_type_ids in the batch; position ids computed from the input ids)
    ("roberta-mlm", _roberta("RobertaForMaskedLM"), 2, 16, "fp32"),
    ("roberta-mlm-bf16", _roberta("RobertaForMaskedLM", hidden_act="gelu_new"), 3, 24, "bf16"),
    ("roberta-seqcls3", _roberta("RobertaForSequenceClassification", num_labels=3), 3, 8, "fp32"),
    ("roberta-seqcls-bf16", _roberta("RobertaForSequenceClassification", type_vocab_size=2), 2, 16, "bf16"),
    ("roberta-tokcls5", _roberta("RobertaForTokenClassification", num_labels=5, num_hidden_layers=1), 2, 16,
     "fp32"),
    ("roberta-tokcls-bf16", _roberta("RobertaForTokenClassification", id2label={"0": "O", "1": "B", "2": "I"}), 1,
     24, "bf16"),

    # --- Falcon: sequential + ALiBi (falcon-rw), multi-query + parallel (falcon-7b), new_decoder_architecture
    # (falcon-40b/180b: grouped kv, ln_attn + ln_mlp or one input_layernorm), per-head q|k|v; tied and untied
    ("falcon-rw-alibi-seq-bias", _falcon(alibi=True, bias=True, multi_query=False, parallel_attn=False), 2, 16, "fp32"),
    ("falcon-rw-alibi-6heads-untied-bf16", _falcon(hidden_size=48, num_attention_heads=6, alibi=True, bias=True,
                                                   multi_query=False, parallel_attn=False, tie_word_embeddings=False),
     2, 24, "bf16"),
    ("falcon-mq-parallel-untied", _falcon(tie_word_embeddings=False), 2, 16, "fp32"),
    ("falcon-mq-parallel-bf16", _falcon(), 3, 16, "bf16"),
    ("falcon-newarch-kv2-bf16", _falcon(num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True), 2, 16,
     "bf16"),
    # (ffn 512: with the default 256 the backward peak falls on `qkv[:, :, :, [-2]]`'s backward, where the oracle's
    # dispatch mode makes index_backward out of place (isTensorSubclassLike) and keeps the `:` slices: +2,040 B)
    ("falcon-newarch-ln1-bias-untied", _falcon(num_kv_heads=2, new_decoder_architecture=True, num_ln_in_parallel_attn=1,
                                               bias=True, tie_word_embeddings=False, ffn_hidden_size=512), 2, 16,
     "fp32"),
    # bf16 autocast: FalconLinear's `+ self.bias` promotes the bf16 matmul to the float32 bias
    ("falcon-amp-rw-alibi", _falcon(alibi=True, bias=True, multi_query=False, parallel_attn=False), 2, 16,
     "bf16-amp"),
    ("falcon-amp-newarch-bias", _falcon(num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True,
                                        bias=True), 2, 16, "bf16-amp"),
    ("falcon-perhead-rotary-seq-bf16", _falcon(multi_query=False, parallel_attn=False, ffn_hidden_size=96), 2, 32,
     "bf16"),
    # --- T5 (encoder-decoder; --target-seq is the decoder's length, labels (B, N)): v1.0 relu with a tied head
    # (sequence_output * d_model**-0.5), v1.1 / flan gated-gelu with an untied head and fewer decoder blocks
    ("t5-relu-tied", _t5(), 2, 16, "fp32", {"target_seq": 8}),
    ("t5-relu-tied-bf16", _t5(), 2, 24, "bf16", {"target_seq": 12}),
    ("t5-gated-untied", _t5(d_kv=8, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                            num_decoder_layers=1), 3, 12, "fp32", {"target_seq": 10}),
    ("t5-gated-untied-bf16", _t5(d_kv=8, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                 num_decoder_layers=1), 2, 32, "bf16", {"target_seq": 16}),
    # (no bf16-autocast row: T5's CrossEntropyLoss takes the 16-bit logits as they are, and torch 1.13's CPU autocast
    # casts them to float32 before log_softmax where CUDA 2.x's cross_entropy_loss keeps log_softmax in their dtype
    # (ops_nn.cc cross_entropy); in a relu row under autocast the forward matched allocation for allocation up to
    # the loss)
    # --- frozen parameters (trainmem --freeze GLOB)
    ("frozen-llama-emb-L0", _ll("llama"), 2, 16, "fp32",
     {"freeze": ["model.embed_tokens.*", "model.layers.0.*"]}),
    ("frozen-qwen2-emb-L0-bf16", _ll("qwen2"), 2, 32, "bf16",
     {"freeze": ["model.embed_tokens.*", "model.layers.0.*"]}),
    ("frozen-gpt2-all-but-last", {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128,
                                  "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
     2, 16, "fp32", {"freeze": ["transformer.wte.*", "transformer.wpe.*", "transformer.h.0.*"]}),
    ("frozen-llama-attn", _ll("llama", head_dim=24), 2, 16, "fp32", {"freeze": ["*self_attn*"]}),
    ("frozen-lm_head-gpt2-untied-bf16", {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32,
                                         "vocab_size": 96, "n_positions": 64, "tie_word_embeddings": False,
                                         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
     2, 16, "bf16", {"freeze": ["lm_head.*"]}),
    # --- gradient checkpointing (trainmem --checkpointing full --checkpoint-reentrant B --checkpoint-every N)
    ("ckpt-llama-reentrant", _ll("llama"), 2, 16, "fp32", {"checkpointing": "full", "reentrant": True}),
    ("ckpt-llama-nonreentrant", _ll("llama"), 2, 16, "fp32", {"checkpointing": "full", "reentrant": False}),
    ("ckpt-gemma3-text-reentrant", _ll("gemma3_text", num_hidden_layers=3, head_dim=16, sliding_window=8,
                                       sliding_window_pattern=2), 2, 16, "fp32",
     {"checkpointing": "full", "reentrant": True}),
    ("ckpt-llama-reentrant-every2-L4-bf16", _ll("llama", num_hidden_layers=4), 2, 16, "bf16",
     {"checkpointing": "full", "reentrant": True, "every": 2}),
    ("ckpt-gpt2-reentrant", {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128,
                             "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
     2, 16, "fp32", {"checkpointing": "full", "reentrant": True}),
    ("ckpt-gpt2-nonreentrant-bf16", {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 48,
                                     "vocab_size": 80, "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                     "attn_pdrop": 0.0}, 3, 24, "bf16", {"checkpointing": "full", "reentrant": False}),
    ("ckpt-nanogpt-reentrant", {"model_type": "nanogpt", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128,
                                "block_size": 64, "bias": True, "dropout": 0.0}, 2, 32, "fp32",
     {"checkpointing": "full", "reentrant": True}),
    # LoRA-like: frozen embeddings, so no checkpoint input requires grad. Reentrant: CheckpointFunction's output
    # then does not require grad either, so no decoder layer gets a gradient (PyTorch warns "None of the inputs
    # have requires_grad=True. Gradients will be None"); non-reentrant: every layer gets its gradients.
    ("lora-like-llama-reentrant", _ll("llama"), 2, 16, "fp32",
     {"freeze": ["model.embed_tokens.*"], "checkpointing": "full", "reentrant": True}),
    ("lora-like-llama-nonreentrant", _ll("llama"), 2, 16, "fp32",
     {"freeze": ["model.embed_tokens.*"], "checkpointing": "full", "reentrant": False}),

    # --- bf16 autocast (float32 weights): trainmem --precision bf16-amp
    ("amp-llama-gqa-hd24", _ll("llama", head_dim=24), 2, 16, "bf16-amp"),
    ("amp-neox-parallel", {"model_type": "gpt_neox", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 256,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "rotary_pct": 0.25,
                           "use_parallel_residual": True, "attention_dropout": 0.0, "hidden_dropout": 0.0},
     2, 16, "bf16-amp"),

    # --- PEFT LoRA (peft_lora.py; trainmem --lora SPEC [--lora-dtype fp32|base] [--input-require-grads B]).
    # "bf16" is a base model cast to bf16 (adapters upcast to fp32 unless lora_dtype base); "bf16-amp" float32
    # base weights under autocast.
    ("lora-llama-qv-r4", _ll("llama"), 2, 16, "fp32", {"lora": "r=4,alpha=8"}),
    ("lora-llama-defaults-bf16", _ll("llama", head_dim=24), 2, 16, "bf16", {"lora": "alpha=16"}),
    ("lora-llama-all-linear-r16-bf16", _ll("llama"), 2, 32, "bf16",
     {"lora": "r=16,alpha=32,targets=all-linear", "lora_dtype": "fp32"}),
    ("lora-llama-qkvo-base-dtype-bf16", _ll("llama"), 2, 16, "bf16",
     {"lora": "r=8,alpha=16,targets=q_proj+k_proj+v_proj+o_proj", "lora_dtype": "base"}),
    ("lora-llama-dropout0.1", _ll("llama"), 2, 16, "fp32", {"lora": "r=8,alpha=16,dropout=0.1"}),
    ("lora-qwen2-all-linear-dropout0.1-bf16", _ll("qwen2"), 2, 16, "bf16",
     {"lora": "r=4,alpha=8,dropout=0.1,targets=all-linear"}),
    ("lora-gpt2-c_attn", {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128,
                          "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
     2, 16, "fp32", {"lora": "r=8,alpha=16"}),
    ("lora-gpt2-all-linear-bf16", {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 48, "vocab_size": 80,
                                   "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
     3, 24, "bf16", {"lora": "r=4,alpha=8,targets=all-linear"}),
    ("lora-neox-default-bf16", {"model_type": "gpt_neox", "vocab_size": 96, "hidden_size": 64,
                                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                                "rotary_pct": 0.25, "use_parallel_residual": False, "attention_dropout": 0.0,
                                "hidden_dropout": 0.0}, 2, 32, "bf16", {"lora": "r=8,alpha=16"}),
    ("lora-opt-default", {"model_type": "opt", "vocab_size": 96, "hidden_size": 64, "ffn_dim": 256,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
                          "do_layer_norm_before": True, "dropout": 0.0, "attention_dropout": 0.0,
                          "activation_dropout": 0.0}, 2, 16, "fp32", {"lora": "r=8,alpha=16"}),
    # enable_input_require_grads without checkpointing: the bf16 embeddings output becomes a leaf that requires
    # grad; the first RMSNorm and the layer-0 projections' inputs then save their tensors
    ("lora-llama-input-grads-bf16", _ll("llama"), 2, 16, "bf16", {"lora": "r=4,alpha=8", "input_require_grads": True}),
    ("lora-llama-bf16-amp", _ll("llama"), 2, 16, "bf16-amp", {"lora": "r=8,alpha=16,targets=q_proj+v_proj"}),
    # LoRA with checkpointing: reentrant with enable_input_require_grads (what PEFT / transformers switch on), reentrant
    # without it on every 2nd layer (the checkpointed layers' adapters get no gradient: only layers 1 and 3 train),
    # and non-reentrant
    ("lora-llama-ckpt-reentrant-input-grads", _ll("llama"), 2, 16, "fp32",
     {"lora": "r=4,alpha=8", "checkpointing": "full", "reentrant": True, "input_require_grads": True}),
    ("lora-llama-ckpt-reentrant-every2-no-input-grads-bf16", _ll("llama", num_hidden_layers=4), 2, 16, "bf16",
     {"lora": "r=8,alpha=16,targets=all-linear", "checkpointing": "full", "reentrant": True, "every": 2,
      "input_require_grads": False}),
    ("lora-llama-ckpt-nonreentrant-bf16", _ll("llama"), 2, 16, "bf16",
     {"lora": "r=16,alpha=32,dropout=0.1", "checkpointing": "full", "reentrant": False}),
    # memory-lean optimizers (validate/cpu/optimizers.py): transformers' Adafactor (float32 factored moments and a
    # 0-d float32 RMS per parameter, whatever the parameter dtype) and torch's (keepdim row/col variances in the
    # gradient's dtype, its `step` on the CPU); optimizer state and gradient bytes must be exact
    ("adafactor-gpt2-tied", {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128,
                             "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}, 2, 16,
     "fp32", {"optimizer": "adafactor"}),
    ("adafactor-llama-bf16", _ll("llama", head_dim=24), 2, 16, "bf16", {"optimizer": "adafactor"}),
    ("adafactor-llama-bf16-amp", _ll("llama"), 2, 16, "bf16-amp", {"optimizer": "adafactor"}),
    ("adafactor-torch-gpt2-tied", {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64,
                                   "vocab_size": 128, "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                   "attn_pdrop": 0.0}, 2, 16, "fp32", {"optimizer": "adafactor-torch"}),
    ("adafactor-torch-llama-bf16", _ll("llama", head_dim=24), 2, 16, "bf16", {"optimizer": "adafactor-torch"}),
    ("adafactor-torch-lora-llama-bf16", _ll("llama"), 2, 16, "bf16",
     {"optimizer": "adafactor-torch", "lora": "r=8,alpha=16"}),
    # transformers' logits_to_keep in training: the head and the loss over the last N positions (models.keep_logits)
    ("keep-llama-4", _ll("llama"), 2, 16, "fp32", {"logits_to_keep": 4}),
    ("keep-gpt2-1-bf16", {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128,
                          "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
     2, 16, "bf16", {"logits_to_keep": 1}),
    ("keep-opt-8", {"model_type": "opt", "vocab_size": 96, "hidden_size": 64, "ffn_dim": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
                    "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}, 2, 16, "fp32",
     {"logits_to_keep": 8}),
    ("keep-qwen2-lora-ckpt-bf16", _ll("qwen2"), 2, 16, "bf16", {"logits_to_keep": 5, "lora": "r=4,alpha=8", "checkpointing": "full", "reentrant": True,
              "input_require_grads": True}),
    # torchtune's chunked output head + CEWithChunkedOutputLoss (torchtune_loss.py; trainmem --loss chunked)
    ("chunked-llama-8", _ll("llama"), 2, 16, "fp32", {"loss": "chunked", "loss_chunks": 8}),
    ("chunked-llama-4-bf16", _ll("llama"), 2, 16, "bf16", {"loss": "chunked", "loss_chunks": 4}),
    ("chunked-llama-2-batch1", _ll("llama"), 1, 16, "fp32", {"loss": "chunked", "loss_chunks": 2}),
    ("chunked-gpt2-4", {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128,
                        "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
     2, 16, "fp32", {"loss": "chunked", "loss_chunks": 4}),
    ("chunked-gpt2-8-bf16", {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128,
                             "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
     2, 16, "bf16", {"loss": "chunked", "loss_chunks": 8}),
    ("chunked-llama-ckpt-nonreentrant", _ll("llama"), 2, 16, "fp32",
     {"loss": "chunked", "loss_chunks": 4, "checkpointing": "full", "reentrant": False}),
    ("chunked-llama-lora-ckpt-bf16", _ll("llama"), 2, 16, "bf16",
     {"loss": "chunked", "loss_chunks": 8, "lora": "r=4,alpha=8", "checkpointing": "full", "reentrant": True,
      "input_require_grads": True}),
    # rank 0 of transformers 5.x tensor parallelism, tp_plan="auto" (tp_shard.py; trainmem --tp): local shards,
    # all_reduce_backward before colwise inputs, all_reduce_forward clones after rowwise outputs, lm_head gathered
    ("tp2-llama", _ll("llama"), 2, 16, "fp32", {"tp": 2}),
    ("tp2-llama-bf16", _ll("llama"), 2, 16, "bf16", {"tp": 2}),
    ("tp2-llama-batch1-bf16", _ll("llama"), 1, 32, "bf16", {"tp": 2}),
    ("tp4-llama-mha", _ll("llama", num_key_value_heads=4), 2, 16, "fp32", {"tp": 4}),
    ("tp2-llama-bias", _ll("llama", attention_bias=True, mlp_bias=True), 2, 16, "fp32", {"tp": 2}),
    ("tp2-llama-bf16-amp", _ll("llama"), 2, 16, "bf16-amp", {"tp": 2}),
    ("tp2-mistral-bf16", _ll("mistral"), 2, 16, "bf16", {"tp": 2}),
    ("tp2-qwen2-untied-bf16", _ll("qwen2", tie_word_embeddings=False), 2, 16, "bf16", {"tp": 2}),
    ("tp2-llama-keep-4", _ll("llama"), 2, 16, "fp32", {"tp": 2, "logits_to_keep": 4}),
    ("tp2-llama-ckpt-nonreentrant-bf16", _ll("llama"), 2, 16, "bf16",
     {"tp": 2, "checkpointing": "full", "reentrant": False}),
    # rank 0 of transformers 5.x expert parallelism, DistributedConfig(tp_size=N, ep_size=N) (ep_shard.py; trainmem
    # --ep): attention and lm_head under the TP plan, E/N local experts, the ep_router mask, the experts' all-reduce
    ("ep2-mixtral-balanced", _ll("mixtral", num_local_experts=4, num_experts_per_tok=2), 2, 11, "fp32", {"ep": 2}),
    ("ep2-mixtral-balanced-bf16", _ll("mixtral", num_local_experts=4, num_experts_per_tok=2), 2, 16, "bf16",
     {"ep": 2}),
    ("ep4-mixtral-top1-bf16", _ll("mixtral", num_local_experts=4, num_experts_per_tok=1, num_key_value_heads=4), 1,
     18, "bf16", {"ep": 4}),
    ("ep2-mixtral-worst-bf16", _ll("mixtral", num_local_experts=4, num_experts_per_tok=2), 2, 16, "bf16",
     {"ep": 2, "moe_routing": "worst"}),
    ("ep2-mixtral-worst-top3-all-local", _ll("mixtral", num_local_experts=8, num_experts_per_tok=3), 2, 8, "fp32",
     {"ep": 2, "moe_routing": "worst"}),
]

# trainmem flags the options need, in the order they are looked for in a rejection message
NEW_FLAGS = ("--freeze", "--checkpointing", "--checkpoint-reentrant", "--checkpoint-every", "--input-require-grads",
             "--lora-dtype", "--lora", "--loss-chunks", "--loss", "--tp", "--ep")
# how a CLI parser (CLI11) says it does not know an argument
_REJECTION_PHRASES = ("not expected", "unknown option", "unrecognized option", "unrecognised option",
                      "does not support", "not supported yet")


def _entry(g):
    name, cfg, batch, seq, prec = g[:5]
    opts = g[5] if len(g) > 5 else {}
    return name, cfg, batch, seq, prec, opts


def _measure_kwargs(opts):
    return {"freeze": list(opts.get("freeze", [])),
            "checkpointing": opts.get("checkpointing", "none"),
            "checkpoint_reentrant": bool(opts.get("reentrant", True)),
            "checkpoint_every": int(opts.get("every", 1)),
            "lora": opts.get("lora"),
            "lora_dtype": opts.get("lora_dtype", "fp32"),
            "enable_input_require_grads": opts.get("input_require_grads"),
            "loss": opts.get("loss", "ce"), "loss_chunks": int(opts.get("loss_chunks", 8)),
            "logits_to_keep": int(opts.get("logits_to_keep", 0)),
            "moe_routing": opts.get("moe_routing", "balanced"),
            "moe_experts": opts.get("moe_experts", "eager"),
            "target_seq": int(opts.get("target_seq", 0)),
            "tp": int(opts.get("tp", opts.get("ep", 1))),
            "ep": int(opts.get("ep", 1))}


def _option_flags(opts):
    flags = []
    for glob in opts.get("freeze", []):
        flags += ["--freeze", glob]
    if opts.get("checkpointing", "none") != "none":
        flags += ["--checkpointing", opts["checkpointing"],
                  "--checkpoint-reentrant", "true" if opts.get("reentrant", True) else "false",
                  "--checkpoint-every", str(int(opts.get("every", 1)))]
    if opts.get("lora") is not None:
        flags += ["--lora", opts["lora"]]
        if opts.get("lora_dtype"):
            flags += ["--lora-dtype", opts["lora_dtype"]]
    if opts.get("loss", "ce") != "ce":  # torchtune's chunked loss (torchtune_loss.py)
        flags += ["--loss", opts["loss"], "--loss-chunks", str(int(opts.get("loss_chunks", 8)))]
    if opts.get("logits_to_keep"):  # transformers' logits_to_keep (models.keep_logits)
        flags += ["--logits-to-keep", str(int(opts["logits_to_keep"]))]
    if opts.get("moe_routing"):  # MoE routers (models.set_moe_routing)
        flags += ["--moe-routing", opts["moe_routing"]]
    if opts.get("moe_experts"):  # experts_implementation (models.set_moe_experts)
        flags += ["--moe-experts", opts["moe_experts"]]
    if opts.get("target_seq"):  # an encoder-decoder's decoder length (T5's labels)
        flags += ["--target-seq", str(int(opts["target_seq"]))]
    if opts.get("input_require_grads") is not None:
        flags += ["--input-require-grads", "true" if opts["input_require_grads"] else "false"]
    if opts.get("optimizer"):
        flags += ["--optimizer", opts["optimizer"]]
    if opts.get("tp"):  # rank 0 of transformers' tensor parallelism (tp_shard.py)
        flags += ["--tp", str(int(opts["tp"]))]
    if opts.get("ep"):  # rank 0 of transformers' expert parallelism (ep_shard.py; tp = ep)
        flags += ["--ep", str(int(opts["ep"]))]
    return flags


def _describe(opts):
    parts = []
    if opts.get("freeze"):
        parts.append("freeze " + " ".join(opts["freeze"]))
    if opts.get("checkpointing", "none") != "none":
        parts.append(f"checkpointing {'reentrant' if opts.get('reentrant', True) else 'non-reentrant'}"
                     f" every {int(opts.get('every', 1))}")
    if opts.get("lora") is not None:
        parts.append(f"lora {opts['lora'] or '(defaults)'}" + (f" dtype {opts['lora_dtype']}"
                                                                if opts.get("lora_dtype") else ""))
    if opts.get("logits_to_keep"):
        parts.append(f"logits_to_keep {int(opts['logits_to_keep'])}")
    if opts.get("target_seq"):
        parts.append(f"target_seq {int(opts['target_seq'])}")
    if opts.get("loss", "ce") != "ce":
        parts.append(f"loss {opts['loss']} x{int(opts.get('loss_chunks', 8))}")
    if opts.get("input_require_grads") is not None:
        parts.append(f"input_require_grads {str(bool(opts['input_require_grads'])).lower()}")
    if opts.get("optimizer"):
        parts.append(f"optimizer {opts['optimizer']}")
    if opts.get("tp"):
        parts.append(f"tp {int(opts['tp'])}")
    if opts.get("ep"):
        parts.append(f"ep {int(opts['ep'])}")
    return "; ".join(parts)


def pending_flag(err_text, returncode, flags):
    """The new flag trainmem rejected, when it exited 2 with its CLI parser saying it does not know one of the
    flags this configuration passes; None otherwise (a real error, or trainmem accepted the flags)."""
    if returncode != 2 or not err_text:
        return None
    low = err_text.lower()
    if not any(p in low for p in _REJECTION_PHRASES):
        return None
    for f in NEW_FLAGS:
        if f in flags and f in err_text:
            return f
    return None


def _impl(model_type):
    if model_type == "mlp":
        return "stack"
    if model_type == "nanogpt":
        return "nanogpt"
    return "hf"


def wait_for(binary, seconds=120):
    """The build dir may be rebuilt concurrently: wait for the executable to (re)appear."""
    deadline = time.time() + seconds
    while not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        if time.time() > deadline:
            return False
        time.sleep(2)
    return True


# The live timeline is compared over one step of the loop measure.py runs: forward (the model computes the loss),
# `loss.backward()` on a loss nothing keeps afterwards, and torch 1.13's AdamW on CPU, whose default is the
# for-loop implementation (_single_tensor_adamw: foreach defaults to False off CUDA): trainmem --loop plain
# --optimizer-impl for-loop --steps 1.
TIMELINE_FLAGS = ["--steps", "1", "--loop", "plain", "--by", "event"]


def run_trainmem(binary, cfg_path, model_type, batch, seq, precision, retries=10, extra=(), timeline=False):
    """(json, None, None) on success; (None, error text, pending flag or None) otherwise. timeline: run
    `trainmem timeline` over measure.py's loop (TIMELINE_FLAGS) instead of `estimate`."""
    cmd = [binary, "timeline" if timeline else "estimate", "--model", cfg_path, "--impl", _impl(model_type),
           "--batch", str(batch), "--seq", str(seq), "--precision", precision, "--optimizer", "adamw",
           "--optimizer-impl", "for-loop" if timeline else "foreach", "--format", "json"] + list(extra)
    if timeline:
        cmd += TIMELINE_FLAGS
    if "--optimizer" in extra:  # another optimizer (with its own implementation): not AdamW's
        del cmd[cmd.index("--optimizer"):cmd.index("--optimizer-impl") + 2]
    if model_type != "mlp":
        cmd[4:4] = ["--attention", "eager"]
    for attempt in range(retries):
        if not wait_for(binary, 20):
            break
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except OSError as e:  # e.g. "text file busy" while the binary is being relinked
            if attempt + 1 < retries:
                time.sleep(2)
                continue
            return None, f"{' '.join(cmd)}: {e}", None
        if p.returncode != 0:
            text = p.stderr.strip() or p.stdout.strip()
            return None, f"{' '.join(cmd)}\nexit {p.returncode}: {text}", pending_flag(text, p.returncode, extra)
        try:
            return json.loads(p.stdout), None, None
        except json.JSONDecodeError as e:
            return None, f"{' '.join(cmd)}: output is not JSON ({e})", None
    return None, f"{binary} not found", None


def _get(d, path):
    for k in path.split("."):
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def compare(measured, tm, compare_raw=False, saved_tolerance=SAVED_TOLERANCE):
    """Rows of (quantity, measured, trainmem or None, status, diff %)."""
    rows = []
    mem = tm.get("memory", {}) if tm else {}

    def row(name, m, t, exact=True, tol=0.0, info=False):
        if t is None:
            status = "missing"
            diff = None
        else:
            diff = 0.0 if m == t == 0 else (100.0 * (t - m) / m if m else float("inf"))
            ok = (t == m) if exact else abs(t - m) <= tol * abs(m)
            status = ("ok" if ok else "differs") if info else ("ok" if ok else "FAIL")
        rows.append({"quantity": name, "measured": m, "trainmem": t, "diff_pct": diff, "status": status,
                     "informational": info})

    row("parameters", measured["parameters"], _get(tm, "parameters.count"))
    row("trainable_parameters", measured["trainable_parameters"], _get(tm, "parameters.trainable"))
    row("gradients_bytes", measured["gradients_bytes"], mem.get("gradients_bytes"))
    st = mem.get("optimizer_state_bytes")
    if st is not None:
        st -= mem.get("optimizer_steps_bytes", 0) or 0
    row("optimizer_state_bytes", measured["optimizer_state_bytes"], st)
    key = "saved_activation_bytes" if compare_raw else "saved_activation_bytes_cuda"
    row("saved_activations_bytes", measured[key], mem.get("saved_activations_bytes"), exact=saved_tolerance == 0,
        tol=saved_tolerance)
    row("weights_bytes", measured["weights_bytes"], mem.get("weights_bytes"), info=True)
    row("buffers_bytes", measured["buffers_bytes"], mem.get("buffers_bytes"), info=True)
    return rows


# Live-timeline figures that differ for a reason outside trainmem, pinned to the exact values (measured, trainmem):
# a change on either side fails the grid until it is looked at again.
_NO_EARLY_STOP = ("torch 1.13's non-reentrant checkpoint (checkpoint_without_reentrant) recomputes the whole layer "
                  "on the first unpack and keeps its output until the unpack returns; torch 2.x stops the "
                  "recomputation once the last saved tensor is recomputed (_StopRecomputationError, "
                  "set_checkpoint_early_stop), which trainmem models")
KNOWN_LIVE_DIFFERENCES = {
    "ckpt-llama-nonreentrant": {"live peak: backward": (875468, 859080, _NO_EARLY_STOP)},
    "lora-like-llama-nonreentrant": {"live peak: backward": (867148, 858952, _NO_EARLY_STOP)},
    "chunked-llama-ckpt-nonreentrant": {"live peak: backward": (875468, 859080, _NO_EARLY_STOP)},
    "lora-llama-ckpt-nonreentrant-bf16": {"live peak: backward": (407092, 378408, _NO_EARLY_STOP)},
    "tp2-llama-ckpt-nonreentrant-bf16": {"live peak: backward": (284588, 276392, _NO_EARLY_STOP)},
    "ckpt-gpt2-nonreentrant-bf16": {"live peak: backward": (475606, 475594, _NO_EARLY_STOP + " (here 12 B of "
                                                            "scalars recomputed past the last saved tensor)")},
}


def compare_live(failures, events, segments, name=None):
    """Rows for the live timeline (validate/cpu/live.py): the peak and the end of each segment (forward with the
    loss, backward, optimizer step) must be exact; the event-by-event comparison (the same allocation sizes in
    the same order, and the live bytes after each op) is reported, informational while the reference models'
    op order differs from trainmem's in places that do not move a peak."""
    rows = []
    for seg in segments:
        for what in ("peak", "end"):
            m, t = seg[f"measured_{what}"], seg[f"trainmem_{what}"]
            q = f"live {what}: {seg['segment']}"
            status = "ok" if m == t else "FAIL"
            known = KNOWN_LIVE_DIFFERENCES.get(name, {}).get(q)
            if m != t and known and known[:2] == (m, t):
                status = "known: " + known[2]
            rows.append({"quantity": q, "measured": m, "trainmem": t,
                         "diff_pct": 0.0 if m == t else 100.0 * (t - m) / m, "status": status,
                         "informational": False})
    rows.append({"quantity": "live events", "measured": None, "trainmem": None, "diff_pct": None,
                 "status": "ok" if not events else "differs: " + "; ".join(events), "informational": True})
    if failures:
        rows[-1]["status"] = "FAIL: " + "; ".join(failures + events)
        rows[-1]["informational"] = False
    return rows


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:+.3f}%"
    return f"{v:,}"


def print_table(name, spec, measured, rows, err, elapsed, pending=None):
    cfg_desc = f"{spec['model_type']} B={spec['batch']} T={spec['seq']} {spec['precision']}"
    if spec.get("options"):
        cfg_desc += f"; {spec['options']}"
    print(f"== {name}  ({cfg_desc}, measured in {elapsed:.2f}s)")
    if pending:
        print(f"   pending: trainmem does not support {pending} yet")
    elif err:
        print(f"   trainmem FAILED: {err}")
    w = [25, 15, 15, 11, 8]
    print("   " + "quantity".ljust(w[0]) + "measured".rjust(w[1]) + "trainmem".rjust(w[2]) + "diff".rjust(w[3])
          + "  status")
    for r in rows:
        print("   " + r["quantity"].ljust(w[0]) + _fmt(r["measured"]).rjust(w[1]) + _fmt(r["trainmem"]).rjust(w[2])
              + _fmt(r["diff_pct"]).rjust(w[3]) + "  " + r["status"] + (" (info)" if r["informational"] else ""))
    print(f"   saved activations: cpu torch {measured['torch']} {measured['saved_activation_bytes']:,} B, "
          f"cuda torch 2.x equivalent {measured['saved_activation_bytes_cuda']:,} B "
          f"(inputs {measured['saved_input_bytes']:,} B; {measured['saved_storage_count']} storages)")
    top = ", ".join(f"{k} {v:,}" for k, v in list(measured["saved_by_grad_fn_cuda"].items())[:6])
    print(f"   by grad_fn (cuda): {top}")
    eof = measured["end_of_forward"]
    ck = measured["checkpointing"]
    if ck["mode"] != "none":
        print(f"   end of forward (cuda 2.x bytes): saved by autograd {eof['autograd_saved_bytes_cuda']:,} + checkpoint "
              f"inputs {eof['checkpoint_input_bytes_cuda']:,} = {measured['saved_activation_bytes_cuda']:,} B compared;"
              f" also alive: the partial's kwargs {eof['checkpoint_kwarg_bytes_cuda']:,} B (all alive "
              f"{eof['live_bytes_cuda']:,} B)")
        print(f"   {ck['mode']} checkpoint on layers {ck['layers']}, output requires grad "
              f"{ck['layers_output_requires_grad']}")
    lora = measured.get("lora")
    if lora:
        print(f"   lora r={lora['r']} alpha={lora['alpha']} dropout={lora['dropout']} adapters {lora['adapter_dtype']}"
              f" on {len(lora['targeted_modules'])} modules ({', '.join(lora['targeted_modules'][:4])}"
              f"{', ...' if len(lora['targeted_modules']) > 4 else ''}); enable_input_require_grads "
              f"{str(lora['enable_input_require_grads']).lower()}")
    if eof.get("grad_leaf_bytes_cuda"):
        print(f"   also alive at the end of forward: {eof['grad_leaf_bytes_cuda']:,} B of leaves that require grad "
              f"(enable_input_require_grads' embeddings output, held by its AccumulateGrad node; not a saved "
              f"tensor), whose .grad takes {measured['grad_leaf_grad_bytes']:,} B in backward")
    if measured.get("backward_error"):
        print(f"   backward: {measured['backward_error']}")
    if measured["trainable_parameters"] != measured["parameters"] or ck["mode"] != "none":
        print(f"   trainable {measured['trainable_parameters']:,} of {measured['parameters']:,} parameters; "
              f"{measured['parameters_with_grad']:,} got a gradient")
    for w in measured.get("warnings", []):
        print(f"   torch warning: {w}")
    if eof["unexplained_bytes"]:
        print(f"   ORACLE FAILED: {eof['unexplained_bytes']:,} B alive at the end of forward held by neither autograd "
              f"nor a checkpoint: {eof['unexplained']}")
    if eof["saved_not_in_registry"]:
        print(f"   oracle note: saved tensors no ATen op returned during forward: {eof['saved_not_in_registry']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainmem", required=True, help="path to the trainmem executable")
    ap.add_argument("--out", help="write the full report (JSON) here")
    ap.add_argument("--only", help="run only configurations whose name contains this")
    ap.add_argument("--compare-raw", action="store_true",
                    help="compare saved activations with the raw CPU torch 1.13 figure instead of the CUDA "
                         "torch 2.x equivalent")
    ap.add_argument("--list", action="store_true", help="list the configurations and exit")
    a = ap.parse_args(argv)
    grid = [_entry(g) for g in GRID if not a.only or a.only in g[0]]
    if a.list:
        for name, cfg, b, t, p, opts in grid:
            print(f"{name:36s} {cfg['model_type']:9s} B={b} T={t} {p}" + (f"  {_describe(opts)}" if opts else ""))
        return 0
    binary = os.path.abspath(a.trainmem)
    if not wait_for(binary):
        print(f"{binary}: not found (build it with `make build`)", file=sys.stderr)
        return 1
    report = []
    failures = 0
    missing = 0
    pendings = 0
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="trainmem-grid-") as tmp:
        for name, cfg, batch, seq, prec, opts in grid:
            cfg = dict(cfg)
            # dropout 0 written into the config file itself, for both sides
            cfg = measure.models.zero_dropout(cfg)
            path = os.path.join(tmp, name + ".json")
            with open(path, "w") as f:
                json.dump(cfg, f, indent=1)
            t1 = time.time()
            m = measure.measure(cfg, batch, seq, prec, opts.get("optimizer", "adamw"), dropout_off=True, with_tensors=False,
                                **_measure_kwargs(opts))
            elapsed = time.time() - t1
            tm, err, pending = run_trainmem(binary, path, cfg["model_type"], batch, seq, prec,
                                            extra=_option_flags(opts))
            # configurations with options compare saved activations exactly
            rows = compare(m, tm, a.compare_raw, saved_tolerance=0.0 if opts else SAVED_TOLERANCE)
            if tm is not None and not m.get("backward_error"):
                tl, tl_err, _ = run_trainmem(binary, path, cfg["model_type"], batch, seq, prec,
                                             extra=_option_flags(opts), timeline=True)
                if tl_err:
                    live = ([f"trainmem timeline failed: {tl_err}"], [], [])
                else:
                    live = live_timeline.compare(m, tl)
                rows += compare_live(*live, name)
            spec = {"model_type": cfg["model_type"], "batch": batch, "seq": seq, "precision": prec}
            if opts:
                spec["options"] = _describe(opts)
            print_table(name, spec, m, rows, err, elapsed, pending)
            oracle_bad = m["end_of_forward"]["unexplained_bytes"] != 0
            bad = oracle_bad or (bool(err) and not pending) or any(r["status"].startswith("FAIL") for r in rows)
            failures += bad
            pendings += bool(pending) and not bad
            missing += not pending and any(r["status"] == "missing" and not r["informational"] for r in rows)
            report.append({"name": name, "config": cfg, **spec, "trainmem_flags": _option_flags(opts),
                           "measured": m, "trainmem_memory": (tm or {}).get("memory"),
                           "trainmem_parameters": (tm or {}).get("parameters"), "trainmem_error": err,
                           "pending": (f"trainmem does not support {pending} yet" if pending else None),
                           "comparisons": rows, "ok": not bad})
    total = time.time() - t0
    print()
    print(f"{len(grid)} configurations in {total:.1f}s: {len(grid) - failures - pendings} ok, {failures} failing"
          + (f", {pendings} pending (trainmem does not accept their flags yet)" if pendings else "")
          + (f", {missing} with comparisons missing from trainmem's output" if missing else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"configurations": report, "failures": failures, "pending": pendings, "seconds": total,
                       "compared_saved": "raw cpu" if a.compare_raw else "cuda torch 2.x equivalent"}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
