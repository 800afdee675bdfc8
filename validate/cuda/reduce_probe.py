"""The blocks a CUDA sum over leading dimensions allocates (gpu_reduce_kernel's global-reduction staging buffer and
semaphores, aten/src/ATen/native/cuda/Reduce.cuh: ReduceConfig::global_memory_size() and semaphore_size()), over
rows R and columns C, for the dtypes a weight gradient's sum_to takes: the data for transliterating setReduceConfig
(validate/cuda/layer_backward_probe.py found a 128 MiB one per RMSNorm weight gradient at R = 4096, C = 4096 bf16).

For each (dtype, R, C) it makes x (R, C) and records the allocations of x.sum(0) (the same reduction as
_sum_to's sum over the broadcast dimensions of a (B, T, C) gradient, whose TensorIterator coalesces B and T).
Writes the device's properties and one JSON line per case to --out.

    python3 validate/cuda/reduce_probe.py --out $OUT/reduce_probe.jsonl
"""
import argparse
import json

import torch

ROWS = [256, 1024, 2048, 4096, 8192, 16384, 65536]
COLS = [64, 768, 2048, 4096, 8192]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def probe(dt, r, c):
    x = torch.randn(r, c, device="cuda", dtype=DTYPES[dt])
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1000)
    y = x.sum(0)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    del y
    return [[ev["action"], ev["size"]] for tr in snap["device_traces"] for ev in tr
            if ev["action"] in ("alloc", "free_completed")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    p = torch.cuda.get_device_properties(0)
    env = {"torch": torch.__version__, "gpu": p.name, "multi_processor_count": p.multi_processor_count,
           "max_threads_per_multi_processor": p.max_threads_per_multi_processor,
           "warp_size": getattr(p, "warp_size", 32)}
    with open(args.out, "w") as f:
        f.write(json.dumps({"env": env}) + "\n")
        for dt in DTYPES:
            for r in ROWS:
                for c in COLS:
                    if r * c > (1 << 31):
                        continue
                    row = {"dtype": dt, "rows": r, "cols": c, "events": probe(dt, r, c)}
                    torch.cuda.empty_cache()
                    f.write(json.dumps(row) + "\n")
                    print(dt, r, c, [s for a, s in row["events"] if a == "alloc"], flush=True)


if __name__ == "__main__":
    main()
