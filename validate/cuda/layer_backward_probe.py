"""Which op makes each block of 1 MiB or more in one HF Llama decoder layer's backward, with the allocator's stack
traces: the data for the blocks the pipeline and single-GPU Llama runs show and trainmem does not make (a 32 MiB
and a 128 MiB block around post_attention_layernorm's backward; validate/cuda/README.md).

It builds transformers' LlamaDecoderLayer with Llama-3-8B's shapes (hidden 4096, 32 heads, 8 key-value heads,
MLP 14336) in bf16, runs it on a (B, T, C) input that requires grad with SDPA attention and the rotary
position embeddings the model would pass, then records the backward with
torch.cuda.memory._record_memory_history(stacks="all") and writes, for every allocation and free of 1 MiB or
more, its size and the innermost frames that name an ATen op or a Python function. One JSON line per run to --out.

    python3 validate/cuda/layer_backward_probe.py --out $OUT/layer_backward_probe.jsonl
"""
import argparse
import json

import torch
from sdpa_probe import backward_trace  # this directory's
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding


def frames_of(ev):
    out = []
    for f in ev.get("frames", []):
        name = f.get("name", "")
        fn = f.get("filename", "")
        if any(k in name for k in ("at::native", "at::_ops", "autograd", "Backward", "cudnn", "reduce", "sum")) or fn.endswith(".py"):
            out.append(f"{name} @ {fn.split('/')[-1]}:{f.get('line', 0)}")
        if len(out) >= 14:
            break
    return out


def run(b, t, autocast):
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=1, max_position_embeddings=8192, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    dt = torch.float32 if autocast else torch.bfloat16
    layer = LlamaDecoderLayer(cfg, 0).to("cuda", dt)
    rope = LlamaRotaryEmbedding(cfg).to("cuda")
    x = torch.randn(b, t, 4096, device="cuda", dtype=dt, requires_grad=True)
    pos = torch.arange(t, device="cuda")[None].expand(b, t)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else torch.autocast("cuda", enabled=False)
    with ctx:
        cos, sin = rope(x, pos)
        out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
        out = out[0] if isinstance(out, tuple) else out
    trace = backward_trace(out, torch.randn_like(out), stacks="all")
    return [{"action": ev["action"], "size": ev["size"], "frames": frames_of(ev)} for ev in trace if ev["size"] >= (1 << 20)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import transformers
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "transformers": transformers.__version__}
    with open(args.out, "w") as f:
        f.write(json.dumps({"env": env}) + "\n")
        for b, t, autocast in [(2, 2048, False), (2, 2048, True), (1, 4096, False)]:
            try:
                row = {"batch": b, "seq": t, "autocast": autocast, "events": run(b, t, autocast)}
            except Exception as e:
                row = {"batch": b, "seq": t, "autocast": autocast, "error": repr(e)[:500]}
            torch.cuda.empty_cache()
            f.write(json.dumps(row) + "\n")
            if "error" in row:
                print(b, t, autocast, row["error"], flush=True)
            else:
                print(b, t, autocast, [(e["action"][0], e["size"] >> 20) for e in row["events"]], flush=True)


if __name__ == "__main__":
    main()
