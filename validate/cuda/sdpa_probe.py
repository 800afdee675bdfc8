"""The blocks scaled_dot_product_attention's backward allocates, per backend and shape, on one GPU: the data for
modelling cuDNN attention's backward workspace, which the HF Llama runs show as one block where trainmem makes
three (validate/cuda/README.md, the pipeline runs' note: 134,742,272 B at B 2, H 32, KV 8, T 2048, D 128 bf16).

For each shape it makes q (B, H, T, D), k and v (B, KV, T, D) and passes them as transformers' sdpa_attention_forward
may (k and v expanded to H heads by repeat_kv, or enable_gqa=True: both are probed), runs the causal forward under
the backend given ("default": the one PyTorch picks), then records every allocation and free of
the backward with torch.cuda.memory._record_memory_history and prints them (size in bytes, in order). Writes one
JSON line per (backend, shape) to the file named by --out.

    python3 validate/cuda/sdpa_probe.py --out $OUT/sdpa_probe.jsonl
"""
import argparse
import contextlib
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [  # (B, H, KV, T, D)
    (2, 32, 8, 2048, 128),   # Llama-3-8B, the pipeline and FSDP runs' shape
    (1, 32, 8, 2048, 128),
    (2, 32, 8, 1024, 128),
    (2, 32, 8, 4096, 128),
    (4, 32, 32, 2048, 64),   # no GQA, D 64
    (2, 16, 16, 2048, 128),
    (2, 32, 32, 2048, 96),   # Phi-3-mini's heads (D 96)
    (1, 8, 8, 333, 128),     # an odd length
]
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def repeat_kv(x, n):
    # transformers' repeat_kv: (B, KV, T, D) -> (B, KV * n, T, D) through expand + reshape (a copy)
    if n == 1:
        return x
    b, kv, t, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n, t, d).reshape(b, kv * n, t, d)


def backward_trace(out, grad, stacks=None):
    """The allocator's alloc and free_completed entries while out.backward(grad) runs (with stack traces when
    stacks is "all")."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200000, **({"stacks": stacks} if stacks else {}))
    out.backward(grad)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return [ev for tr in snap["device_traces"] for ev in tr if ev["action"] in ("alloc", "free_completed")]


def probe(backend, shape, gqa):
    b, h, kv, t, d = shape
    dev = "cuda"
    q = torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, kv, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, kv, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    with (sdpa_kernel([BACKENDS[backend]]) if BACKENDS[backend] is not None else contextlib.nullcontext()):
        if gqa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, repeat_kv(k, h // kv), repeat_kv(v, h // kv), is_causal=True)
        trace = backward_trace(out, torch.randn_like(out))
    return [[ev["action"], ev["size"]] for ev in trace]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
           "cudnn": torch.backends.cudnn.version()}
    with open(args.out, "w") as f:
        f.write(json.dumps({"env": env}) + "\n")
        for backend in BACKENDS:
            for shape in SHAPES:
                for gqa in ([False, True] if shape[2] < shape[1] else [False]):
                    try:
                        row = {"backend": backend, "shape": shape, "enable_gqa": gqa, "events": probe(backend, shape, gqa)}
                    except Exception as e:  # a backend that does not take the shape
                        row = {"backend": backend, "shape": shape, "enable_gqa": gqa, "error": str(e)[:300]}
                    torch.cuda.empty_cache()
                    f.write(json.dumps(row) + "\n")
                    print(backend, shape, gqa, row.get("error") or [s for a, s in row["events"] if a == "alloc"], flush=True)


if __name__ == "__main__":
    main()
