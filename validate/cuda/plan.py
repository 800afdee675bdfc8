#!/usr/bin/env python3
"""The measurements to take whenever a GPU machine is lent: each entry runs validate/cuda/measure.py in its
own process (a fresh caching allocator) and writes $OUT/<gpu>_<name>.json. Chosen to cover what trainmem
simulates differently: both implementations and loops, eager and SDPA attention, autocast and pure bf16, GQA
with rotary embeddings, foreach and fused AdamW, gradient accumulation, expandable segments, gradient
checkpointing and LoRA (peft). Every entry fits
a 78 GiB H100 and the whole plan runs in a few minutes.

    python3 validate/cuda/plan.py --out "$OUT"             # all
    python3 validate/cuda/plan.py --out "$OUT" --only gpt2  # names containing "gpt2"
    python3 validate/cuda/plan.py --out "$OUT" --only ddp8,fsdp  # names containing either

Then, on the development machine: copy the files into validate/measured/ and run
`/usr/bin/python3 validate/compare.py --trainmem build/trainmem`.
"""

import argparse
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

PLAN = [
    ("nanogpt_gpt2_eager_b12_t1024_bf16amp",
     "--model nanogpt-gpt2 --attention eager --batch 12 --seq 1024 --precision bf16-amp"),
    ("nanogpt_gpt2_sdpa_b12_t1024_fp16amp",
     "--model nanogpt-gpt2 --attention sdpa --batch 12 --seq 1024 --precision fp16-amp"),
    ("hf_gpt2_sdpa_b8_t1024_bf16amp_accum2",
     "--model gpt2 --attention sdpa --batch 8 --seq 1024 --precision bf16-amp --grad-accum 2"),
    ("hf_gpt2_sdpa_b8_t1024_bf16amp",
     "--model gpt2 --attention sdpa --batch 8 --seq 1024 --precision bf16-amp"),
    ("hf_gpt2_eager_b4_t1024_fp32",
     "--model gpt2 --attention eager --batch 4 --seq 1024 --precision fp32"),
    ("hf_llama3_4layers_sdpa_b2_t2048_bf16amp",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16-amp"),
    ("hf_qwen2_0.5b_sdpa_b4_t2048_bf16_fused",
     "--model qwen2-0.5b --attention sdpa --batch 4 --seq 2048 --precision bf16 --optimizer-impl fused"),
    ("hf_tinyllama_eager_b2_t1024_bf16amp_expandable",
     "--model tinyllama-1.1b --attention eager --batch 2 --seq 1024 --precision bf16-amp "
     "--alloc-conf expandable_segments:True"),
    ("hf_pythia_160m_sdpa_b8_t2048_fp16amp",
     "--model pythia-160m --attention sdpa --batch 8 --seq 2048 --precision fp16-amp"),
    # issue 7's fine-tuning techniques: transformers' gradient checkpointing, peft LoRA on a bf16 base (float32
    # adapters), LoRA with checkpointing (peft's enable_input_require_grads)
    ("hf_llama3_4layers_sdpa_b2_t2048_bf16amp_ckpt",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16-amp "
     "--checkpointing full"),
    ("hf_qwen2_0.5b_sdpa_b4_t2048_bf16_lora_qv",
     "--model qwen2-0.5b --attention sdpa --batch 4 --seq 2048 --precision bf16 --lora r=16,alpha=32,targets=q_proj,v_proj"),
    ("hf_tinyllama_sdpa_b4_t2048_bf16_lora_all_ckpt",
     "--model tinyllama-1.1b --attention sdpa --batch 4 --seq 2048 --precision bf16 --lora r=16,alpha=32,targets=all-linear "
     "--checkpointing full"),
    # more families' forward programs (tag "family"): OPT, Phi-2 (partial rotary, parallel block), Gemma-2
    # (eager with logit softcapping), Qwen3 (q/k norms), Falcon-RW (ALiBi), Phi-3 (fused qkv and gate_up)
    ("hf_family_opt_125m_sdpa_b8_t1024_bf16amp",
     "--model opt-125m --attention sdpa --batch 8 --seq 1024 --precision bf16-amp"),
    ("hf_family_phi2_8layers_sdpa_b2_t2048_bf16amp",
     "--model phi-2 --set num_hidden_layers=8 --attention sdpa --batch 2 --seq 2048 --precision bf16-amp"),
    ("hf_family_gemma2_4layers_eager_b2_t1024_bf16amp",
     "--model gemma-2-2b --set num_hidden_layers=4 --attention eager --batch 2 --seq 1024 --precision bf16-amp"),
    ("hf_family_qwen3_0.6b_sdpa_b4_t2048_bf16",
     "--model qwen3-0.6b --attention sdpa --batch 4 --seq 2048 --precision bf16"),
    ("hf_family_falcon_rw_1b_sdpa_b2_t1024_bf16amp",
     "--model falcon-rw-1b --attention sdpa --batch 2 --seq 1024 --precision bf16-amp"),
    ("hf_family_phi3_4layers_sdpa_b2_t2048_bf16amp",
     "--model phi-3-mini --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16-amp"),
    # (tag "scale") whole models and long sequences: Gemma-3's sliding-window layers (whole 1B, never measured),
    # TinyLlama whole at 4k with full checkpointing, Mistral-7B's shapes at 4k in pure bf16 with fused AdamW
    ("hf_scale_gemma3_1b_sdpa_b2_t2048_bf16amp",
     "--model gemma-3-1b-it --attention sdpa --batch 2 --seq 2048 --precision bf16-amp"),
    ("hf_scale_tinyllama_sdpa_b4_t4096_bf16amp_ckpt",
     "--model tinyllama-1.1b --attention sdpa --batch 4 --seq 4096 --precision bf16-amp --checkpointing full"),
    ("hf_scale_mistral7b_4layers_sdpa_b2_t4096_bf16_fused",
     "--model mistral-7b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 4096 --precision bf16 "
     "--optimizer-impl fused"),
    # (tags "infer", "gen", "moe") what no GPU had measured: a forward under torch.inference_mode() (pure bf16 and
    # bf16 autocast), greedy generate() with the DynamicCache (pure bf16; autocast, whose values cache is float32;
    # a long prompt), and a mixture-of-experts block with transformers 5.x's default grouped_mm experts
    ("hf_infer_llama3_4layers_sdpa_b4_t2048_bf16",
     "--model llama-3-8b --set num_hidden_layers=4 --task inference --attention sdpa --batch 4 --seq 2048 --precision bf16"),
    ("hf_infer_qwen2_0.5b_sdpa_b8_t2048_bf16amp",
     "--model qwen2-0.5b --task inference --attention sdpa --batch 8 --seq 2048 --precision bf16-amp"),
    ("hf_gen_tinyllama_sdpa_b4_t512_n64_bf16",
     "--model tinyllama-1.1b --task inference --generate 64 --attention sdpa --batch 4 --seq 512 --precision bf16"),
    ("hf_gen_qwen2_0.5b_sdpa_b8_t1024_n32_bf16amp",
     "--model qwen2-0.5b --task inference --generate 32 --attention sdpa --batch 8 --seq 1024 --precision bf16-amp"),
    ("hf_gen_llama3_4layers_sdpa_b2_t4096_n16_bf16",
     "--model llama-3-8b --set num_hidden_layers=4 --task inference --generate 16 --attention sdpa --batch 2 "
     "--seq 4096 --precision bf16"),
    ("hf_infer2_llama3_4layers_eager_b2_t2048_bf16",
     "--model llama-3-8b --set num_hidden_layers=4 --task inference --attention eager --batch 2 --seq 2048 --precision bf16"),
    ("hf_infer2_gpt2_eager_b8_t1024_fp32",
     "--model gpt2 --task inference --attention eager --batch 8 --seq 1024 --precision fp32"),
    ("hf_gen2_gpt2_sdpa_b8_t512_n64_fp32",
     "--model gpt2 --task inference --generate 64 --attention sdpa --batch 8 --seq 512 --precision fp32"),
    ("hf_gen2_mistral7b_4layers_sdpa_b1_t2048_n32_bf16",
     "--model mistral-7b --set num_hidden_layers=4 --task inference --generate 32 --attention sdpa --batch 1 "
     "--seq 2048 --precision bf16"),
    ("hf_infer3_gemma3_1b_sdpa_b4_t2048_bf16",
     "--model gemma-3-1b-it --task inference --attention sdpa --batch 4 --seq 2048 --precision bf16"),
    ("hf_moe_qwen3moe_2layers_sdpa_b2_t1024_bf16_grouped_mm",
     "--model qwen3-30b-a3b --set num_hidden_layers=2 --attention sdpa --batch 2 --seq 1024 --precision bf16 "
     "--moe-experts grouped_mm"),
    ("hf_moe_mixtral_2layers_sdpa_b2_t1024_bf16_grouped_mm",
     "--model mixtral-8x7b --set num_hidden_layers=2 --attention sdpa --batch 2 --seq 1024 --precision bf16 "
     "--moe-experts grouped_mm"),
    # issue 11 (tag "dist"): rank 0 of 8 data-parallel ranks over torch's fake process group (measure.py
    # init_fake_process_group), the Llama-3-8B cut to 4 layers of hf_llama3_4layers_sdpa_b2_t2048_bf16amp: DDP,
    # FSDP2 through accelerate (plain, checkpointed, accumulating), FSDP1 through accelerate, HSDP 2 x 4; and the
    # one-GPU run through accelerate's prepare (the Trainer's convert_outputs_to_fp32)
    ("hf_dist_ddp8_llama3_4layers_sdpa_b2_t2048_bf16amp",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16-amp "
     "--sharding ddp --world 8"),
    ("hf_accelerate_llama3_4layers_sdpa_b2_t2048_bf16amp",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16-amp "
     "--accelerate"),
    ("hf_dist_fsdp2x8_llama3_4layers_sdpa_b2_t2048_bf16amp",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16-amp "
     "--sharding fsdp2 --world 8"),
    ("hf_dist_fsdp2x8_llama3_4layers_sdpa_b2_t2048_bf16amp_ckpt",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16-amp "
     "--sharding fsdp2 --world 8 --checkpointing full"),
    ("hf_dist_fsdp2x8_llama3_4layers_sdpa_b2_t2048_bf16amp_accum2",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16-amp "
     "--sharding fsdp2 --world 8 --grad-accum 2"),
    ("hf_dist_fsdp1x8_llama3_4layers_sdpa_b2_t2048_bf16amp",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16-amp "
     "--sharding fsdp1 --world 8"),
    ("hf_dist_hsdp2x4_llama3_4layers_sdpa_b2_t2048_bf16amp",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16-amp "
     "--sharding fsdp2 --world 8 --dp-shard 4"),
    # the whole Llama-3-8B under FSDP2 over 8 ranks at batch 2 x 8192 with gradient checkpointing (the README's
    # FSDP2 example with transformers' checkpointing); transformers' own TP over 8 ranks (from_pretrained tp_plan)
    ("hf_dist_fsdp2x8_llama3_8b_sdpa_b2_t8192_bf16amp_ckpt",
     "--model llama-3-8b --attention sdpa --batch 2 --seq 8192 --precision bf16-amp "
     "--sharding fsdp2 --world 8 --checkpointing full"),
    ("hf_dist_tp8_llama3_4layers_sdpa_b2_t2048_bf16amp",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16-amp "
     "--tp 8 --optimizer-impl for-loop"),
    # (tag "dist", "pp") torch.distributed.pipelining as torchtitan v0.2.0 runs it (measure.py run_pipeline): the
    # Llama-3-8B cut to 4 layers over 2 stages (torchtitan's split: embeddings + layers 0-1, layers 2-3 + norm +
    # head), pure bf16, fused AdamW, 4 micro-batches of 2 x 2048; the first and the last rank, 1F1B and GPipe
    ("hf_dist_pp2_1f1b_rank1_llama3_4layers_sdpa_b2_m4_t2048_bf16",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16 "
     "--pp 2 --pp-rank 1 --pp-schedule 1f1b --micro-batches 4"),
    ("hf_dist_pp2_1f1b_rank0_llama3_4layers_sdpa_b2_m4_t2048_bf16",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16 "
     "--pp 2 --pp-rank 0 --pp-schedule 1f1b --micro-batches 4"),
    ("hf_dist_pp2_gpipe_rank1_llama3_4layers_sdpa_b2_m4_t2048_bf16",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16 "
     "--pp 2 --pp-rank 1 --pp-schedule gpipe --micro-batches 4"),
    ("hf_dist_pp2_gpipe_rank0_llama3_4layers_sdpa_b2_m4_t2048_bf16",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16 "
     "--pp 2 --pp-rank 0 --pp-schedule gpipe --micro-batches 4"),
    # a middle stage (pp 4, rank 1: layers 1-2, a receive and a gradient receive buffer per micro-batch, 1F1B's
    # three warmup micro-batches): the input gradients' send lifetimes where other graphs are alive
    ("hf_dist_pp4_1f1b_rank1_llama3_4layers_sdpa_b2_m4_t2048_bf16",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16 "
     "--pp 4 --pp-rank 1 --pp-schedule 1f1b --micro-batches 4"),
    ("hf_dist_pp4_gpipe_rank1_llama3_4layers_sdpa_b2_m4_t2048_bf16",
     "--model llama-3-8b --set num_hidden_layers=4 --attention sdpa --batch 2 --seq 2048 --precision bf16 "
     "--pp 4 --pp-rank 1 --pp-schedule gpipe --micro-batches 4"),
]


def gpu_tag():
    try:
        import torch
        name = torch.cuda.get_device_name()
    except Exception:
        return "gpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    tag = gpu_tag()
    failures = 0
    for name, flags in PLAN:
        if not any(part in name for part in args.only.split(",")):
            continue
        out = os.path.join(args.out, f"{tag}_{name}.json")
        t0 = time.time()
        r = subprocess.run([sys.executable, os.path.join(HERE, "measure.py"), "--name", f"{tag}_{name}",
                            "--out", out] + flags.split())
        print(f"{name}: exit {r.returncode} in {time.time() - t0:.1f} s", flush=True)
        failures += r.returncode != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
