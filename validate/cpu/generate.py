#!/usr/bin/python3
"""The CPU oracle for trainmem --task inference --generate N: greedy generation with transformers' DynamicCache,
run on the reference models (models.py) by a transliteration of transformers 5.x (>= 5.3)
GenerationMixin.generate and _sample, with measure.py's storage registry counting the live tensor bytes after
every op (live.py). Compared with `trainmem timeline --task inference --generate N --by event --format json`:
the peak over the whole generate() call, the live bytes after the prefill (the prompt's forward and its token)
and at the end (the last token appended, the cache still held), exactly.

    /usr/bin/python3 validate/cpu/generate.py --trainmem build/trainmem

What generate() allocates besides the model's forwards, per transformers 5.x generation/utils.py (quoted in
greedy_generate below): the attention mask and position ids it builds from the prompt, prepare_inputs_for_generation's
clones of the newest input ids (and position ids), the position ids and attention mask grown by torch.cat each
step, the float32 copy of the last logits, and the input ids grown by torch.cat. The model's attention layers
grow each layer's keys and values by torch.cat (models.DynamicCache).

Left out on both sides: the 0-d and 1-d tensors of B elements or fewer that generate()'s own loop makes
(next_tokens, unfinished_sequences, the eos fill, the stopping criteria's flags, the special-token tensors, 0-d
results): trainmem does not model them (each is one 512-byte block of the small pool), so such storages made
outside the model's forward are dropped from the measurement. Everything the model's forwards make is counted.

Like inference.py, torch.no_grad() stands in for inference_mode so composite ops are visible to the mode.
"""

import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import inference  # noqa: E402
import live  # noqa: E402
import measure  # noqa: E402
import models  # noqa: E402

_LL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": 2, "bos_token_id": 1}
_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128, "n_positions": 64,
         "eos_token_id": 127, "bos_token_id": 127}
# (name, config, batch, prompt tokens, new tokens, precision)
GRID = [
    ("gen-llama-fp32", {"model_type": "llama", **_LL}, 2, 12, 5, "fp32"),
    ("gen-llama-bf16", {"model_type": "llama", **_LL}, 3, 16, 4, "bf16"),
    ("gen-llama-mha-fp32", {"model_type": "llama", **_LL, "num_key_value_heads": 4}, 1, 8, 6, "fp32"),
    ("gen-qwen2-bf16-amp", {"model_type": "qwen2", **_LL}, 2, 10, 3, "bf16-amp"),
    ("gen-phi-fp32", {"model_type": "phi", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "partial_rotary_factor": 0.5,
                      "eos_token_id": 2, "bos_token_id": 1, "resid_pdrop": 0.0, "embd_pdrop": 0.0}, 2, 10, 4, "fp32"),
    ("gen-gemma3-bf16", {"model_type": "gemma3_text", "vocab_size": 96, "hidden_size": 64,
                         "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
                         "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 64,
                         "sliding_window_pattern": 2, "eos_token_id": 1, "bos_token_id": 2}, 2, 12, 4, "bf16"),
    ("gen-opt-fp32", {"model_type": "opt", "vocab_size": 96, "hidden_size": 64, "ffn_dim": 128,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
                      "eos_token_id": 2, "bos_token_id": 2}, 2, 12, 5, "fp32"),
    ("gen-falcon-mq-fp32", {"model_type": "falcon", "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "eos_token_id": 2, "bos_token_id": 1}, 2, 12, 5, "fp32"),
    ("gen-falcon-rw-alibi-bf16", {"model_type": "falcon", "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "alibi": True, "bias": True, "multi_query": False,
                                  "parallel_attn": False, "eos_token_id": 2, "bos_token_id": 1}, 2, 10, 4, "bf16"),
    ("gen-falcon-newarch-fp32", {"model_type": "falcon", "vocab_size": 96, "hidden_size": 64,
                                 "num_hidden_layers": 2, "num_attention_heads": 8, "num_kv_heads": 2,
                                 "new_decoder_architecture": True, "eos_token_id": 2, "bos_token_id": 1}, 1, 8, 5,
     "fp32"),
    ("gen-gpt2-fp32", _GPT2, 2, 12, 5, "fp32"),
    ("gen-gpt2-bf16", _GPT2, 1, 20, 4, "bf16"),
    # MoE: every router forced to trainmem's default --moe-routing balanced for each forward's token count
    ("gen-mixtral-fp32", {"model_type": "mixtral", **_LL, "num_local_experts": 4, "num_experts_per_tok": 2}, 2, 10, 4,
     "fp32"),
    ("gen-deepseek_v3-bf16", {"model_type": "deepseek_v3", **_LL, "num_key_value_heads": 4, "q_lora_rank": 24,
                              "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
                              "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                              "moe_intermediate_size": 24, "first_k_dense_replace": 1}, 2, 9, 4, "bf16"),
]


class _ForwardFlag:
    """Marks the storages the model's forwards make (the registry ticks in between)."""

    def __init__(self, registry):
        self.registry = registry
        self.spans = []

    def __enter__(self):
        self.start = self.registry.tick
        return self

    def __exit__(self, *exc):
        self.spans.append((self.start, self.registry.tick))
        return False

    def inside(self, tick):
        return any(a < tick <= b for a, b in self.spans)


def greedy_generate(model, input_ids, max_new_tokens, flag):
    """GenerationMixin.generate(input_ids, max_new_tokens=N) + _sample, greedy, DynamicCache, pad = eos."""
    B, T = input_ids.shape
    # _prepare_attention_mask_for_generation (pad_token_id set: the eos when the config has none)
    pad = torch.tensor([model.eos_token_id])
    default_attention_mask = torch.ones(input_ids.shape[:2], dtype=torch.long, device=input_ids.device)
    is_pad_token_in_inputs = torch.isin(input_ids, pad).any()
    is_pad_token_not_equal_to_eos_token_id = ~(torch.isin(pad, pad).any())
    can_infer_attention_mask = is_pad_token_in_inputs * is_pad_token_not_equal_to_eos_token_id
    attention_mask_from_padding = input_ids.ne(pad[0]).long()
    attention_mask = (attention_mask_from_padding * can_infer_attention_mask
                      + default_attention_mask * ~can_infer_attention_mask)
    del default_attention_mask, attention_mask_from_padding, is_pad_token_in_inputs
    del is_pad_token_not_equal_to_eos_token_id, can_infer_attention_mask
    # _prepare_position_ids_for_generation
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 0)
    model.logits_to_keep = 1  # model_kwargs["logits_to_keep"] = 1
    models.GENERATION.cache = models.DynamicCache()
    unfinished_sequences = torch.ones(B, dtype=torch.long)
    next_token_logits = None
    model_inputs = None
    for i in range(max_new_tokens):
        q = T if i == 0 else 1
        # prepare_inputs_for_generation: input_ids[:, -q:].clone(); position_ids[..., -q:].clone() when their
        # length differs (decode), as they are at the prefill
        ids = input_ids[:, -q:].clone(memory_format=torch.contiguous_format)
        pos = position_ids if position_ids.shape[-1] == q else \
            position_ids[..., -q:].clone(memory_format=torch.contiguous_format)
        model_inputs = {"input_ids": ids, "position_ids": pos}
        del ids, pos
        models.GENERATION.position_ids = model_inputs["position_ids"]
        models.GENERATION.attention_mask = attention_mask  # model_inputs["attention_mask"]: falcon builds from it
        if getattr(model, "moe_forced", None):  # the routing of this forward's tokens (made before the measurement)
            routers, forced = model.moe_forced
            for r, idx in zip(routers, forced[model_inputs["input_ids"].numel()]):
                r.forced_indices = idx
        with flag:
            outputs = model(model_inputs["input_ids"])
        models.GENERATION.position_ids = None
        models.GENERATION.attention_mask = None
        if i == 0:
            model_inputs = None  # _prefill's model_inputs die when it returns
        # _update_model_kwargs_for_generation
        next_position_ids = torch.arange(1, dtype=position_ids.dtype).view(1, -1) + position_ids[..., -1:] + 1
        position_ids = torch.cat([position_ids, next_position_ids], dim=-1)
        del next_position_ids
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        next_token_logits = outputs[:, -1].to(copy=True, dtype=torch.float32)
        next_tokens = torch.argmax(next_token_logits, dim=-1)
        next_tokens = next_tokens * unfinished_sequences + pad[0] * (1 - unfinished_sequences)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        is_done = torch.full((B,), input_ids.shape[-1] >= T + max_new_tokens, dtype=torch.bool)
        is_done = is_done | torch.isin(input_ids[:, -1], pad)
        unfinished_sequences = unfinished_sequences & ~is_done
        del is_done, next_tokens
        del outputs
        if i == 0:
            flag.registry.mark("after prefill")
    flag.registry.mark("end of generate")  # the cache still held
    models.GENERATION.cache = None
    return input_ids


def measure_generate(config, batch, seq, new_tokens, precision, seed=0):
    dtype, autocast_dtype = measure.PRECISIONS[precision]
    torch.manual_seed(seed)
    model = models.build_model(dict(config))
    model.eos_token_id = int(config["eos_token_id"])
    if dtype != torch.float32:
        model.to(dtype)
    model.eval()
    # MoE routers: trainmem's --moe-routing balanced (its default) for the prefill's B*T and each decode step's B
    # tokens, the index tensors made here, outside the measured generate()
    routers = [r for r in model.modules() if isinstance(r, models.MOE_ROUTERS)]
    model.moe_forced = (routers, {n: [models.moe_routing_indices(n, r.top_k, r.num_experts, "balanced")
                                      for r in routers] for n in (batch * seq, batch)}) if routers else None
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(3, model.vocab_size - 1, (batch, seq), dtype=torch.int64, generator=g)
    params, buffers = list(model.parameters()), list(model.buffers())
    base_keys = {models.storage_id(t)[0] for t in params + buffers + [ids]}
    registry = measure._StorageRegistry()
    flag = _ForwardFlag(registry)
    with torch.no_grad():
        with registry:
            if autocast_dtype is not None:
                with torch.autocast("cpu", dtype=autocast_dtype):
                    out = greedy_generate(model, ids, new_tokens, flag)
            else:
                out = greedy_generate(model, ids, new_tokens, flag)
    del out
    # generate()'s own tensors of B elements or fewer (see the module docstring): not modelled by trainmem
    small = {key for key, row in registry.rows.items()
             if len(row[4]) <= 1 and row[2] <= 8 * batch and not flag.inside(registry.spans[key][0])}
    tl = live.build(registry, base_keys | small, dict(registry.cuda_sizes), set(), set())
    return tl, measure._storage_bytes(params + buffers + [ids]), measure._storage_bytes(params + buffers)


def run_trainmem(binary, path, batch, seq, new_tokens, precision):
    cmd = [binary, "timeline", "--model", path, "--attention", "eager", "--batch", str(batch), "--seq", str(seq),
           "--precision", precision, "--task", "inference", "--generate", str(new_tokens), "--by", "event",
           "--format", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()}")
    return json.loads(p.stdout)


def trainmem_figures(tm):
    """The peak, the live bytes after step 1 (the prefill) and at the end of the last step, without the
    CUDA-only workspaces; the base (live after setup)."""
    def live_of(r):
        return r["live_total_bytes"] - r["live_bytes"]["workspaces"]
    rows = tm["rows"]
    setup = [r for r in rows if r["step"] == 0]
    gen = [r for r in rows if r["step"] >= 1]
    last_step = max(r["step"] for r in gen)
    prefill = [r for r in gen if r["step"] == 1]
    final = [r for r in gen if r["step"] == last_step]
    # the end: the row before generate() returns and frees its locals, the first being next_token_logits
    last_free = max(i for i, r in enumerate(final)
                    if r["kind"] == "free" and r["tensor"] == "next_token_logits (float32 copy)")
    return {"base": live_of(setup[-1]) if setup else 0, "peak": max(live_of(r) for r in gen),
            "after_prefill": live_of(prefill[-1]) if len(gen) > len(prefill) else None,
            "end": live_of(final[last_free - 1])}


def main(argv=None):
    binary = inference.trainmem_argument(argv, __doc__)
    failures = 0
    for (name, cfg, batch, seq, new, prec), path in inference.each_config(GRID, "trainmem-gen-"):
        tl, base, weights = measure_generate(cfg, batch, seq, new, prec)
        t = trainmem_figures(run_trainmem(binary, path, batch, seq, new, prec))
        live_, marks = tl["live"], tl["marks"]
        o = {"base": weights, "peak": base + max(live_), "after_prefill": base + live_[marks["after prefill"]],
             "end": base + live_[marks["end of generate"]]}
        keys = ("base", "peak", "end") + (("after_prefill",) if t["after_prefill"] is not None else ())
        ok = all(o[k] == t[k] for k in keys)
        failures += not ok
        print(f"{name:20s} B={batch} T={seq} N={new} {prec:8s} peak {o['peak']:>9,} / {t['peak']:>9,}   "
              f"after prefill {o['after_prefill']:>9,} / {t['after_prefill'] or 0:>9,}   "
              f"end {o['end']:>9,} / {t['end']:>9,}   {'ok' if ok else 'FAIL'}")
    print(f"{len(GRID)} generation configurations: {len(GRID) - failures} ok, {failures} failing "
          "(measured / trainmem)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
