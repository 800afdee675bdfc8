"""The CPU oracle for trainmem --dp N (DDP): the Reducer's gradient buckets of real DistributedDataParallel.

torch 1.13 DDP over the `gloo` backend, world_size 1 in this one process (init_process_group with a file://
store), wrapping the reference models of models.py; three forwards and two backwards, so that the Reducer
rebuilds its buckets at the third forward (DDP._pre_forward -> reducer._rebuild_buckets). The buckets are read
from DDP's own logging data (`ddp._get_ddp_logging_data()`: "bucket_sizes" at construction, in bytes, in the
Reducer's order; after the rebuild "rebuilt_bucket_sizes" and "rebuilt_per_bucket_param_indices", DDP parameter
indices in gradient-ready order) and compared, exactly, with `trainmem estimate --dp 2 --format json`'s "ddp"
object (initial_bucket_bytes, rebuilt_bucket_bytes, rebuilt_bucket_params).

Differences between torch 1.13 CPU/gloo (what runs here) and the CUDA 2.x/NCCL that trainmem models, pinned:
- First bucket cap: torch 2.x's _ddp_init_helper gives the Reducer `dist._DEFAULT_FIRST_BUCKET_BYTES if
  self.bucket_bytes_cap_default else self.bucket_bytes_cap` (an explicit bucket_cap_mb makes the first bucket as
  large as the others); 1.13 passes dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB) always. Rows with an explicit cap
  emulate 2.x here by setting dist._DEFAULT_FIRST_BUCKET_BYTES to that cap before constructing DDP (1.13 reads the
  module attribute at construction) and run trainmem with --torch 2.9; rows with the default cap run trainmem
  with --torch 1.13 (same 1 MiB first bucket in both versions).
- find_unused_parameters=True, construction limits: 2.x uses [bucket_bytes_cap] with an explicit cap and
  [1 MiB, cap] with the default; 1.13 uses [_DEFAULT_FIRST_BUCKET_BYTES, cap], the same under the emulation above.
- gloo has no bfloat16 collectives: bfloat16 rows skip the construction and per-forward broadcasts (broadcast_buffers=False) and replace the all-reduce
  with a no-op comm hook (with one rank both are no-ops; neither decides the buckets).
- The all-reduce: gloo on CPU, NCCL on CUDA; both in place on the flat bucket. NCCL's buffers are outside the
  caching allocator and not modelled.
- Only bucket assignment is compared here (exact): this oracle does not replay DDP's allocations through the
  live-byte registry (live.py), so the buckets' live bytes in `trainmem timeline` are checked by the unit tests
  only. Spot checks made by hand with torch 1.13 (a TorchDispatchMode and torch.profiler(profile_memory=True)
  around DDP(nn.Sequential(Linear(100, 200), Linear(200, 300)))): at construction _sync_module_states's
  aten.cat of the four tensors (80,500 elements) comes first, then the Reducer's aten.empty of the 80,500-element
  bucket, as trainmem orders them; at the rebuild the profiler sees the three new buckets allocated and, without
  a comm hook, no free of the old 322,000-byte bucket in that forward or the next step (something of gloo's
  last all-reduce keeps it; with a Python comm hook it dies when its future is collected). trainmem frees it
  first, as reducer.cpp's initialize_buckets does with `buckets_.clear()` (see loop.cc for NCCL's stash).

Usage:
    /usr/bin/python3 validate/cpu/ddp.py --trainmem build/trainmem
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import inference  # noqa: E402
import measure  # noqa: E402
import models  # noqa: E402

_NANO = {"model_type": "nanogpt", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128, "block_size": 32,
         "bias": True, "dropout": 0.0}
_NANO_BIG = {"model_type": "nanogpt", "n_layer": 2, "n_head": 4, "n_embd": 256, "vocab_size": 2048,
             "block_size": 32, "bias": True, "dropout": 0.0}
_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 128, "n_positions": 32,
         "tie_word_embeddings": True}
_GPT2_UNTIED = dict(_GPT2, tie_word_embeddings=False)
_MLP = {"model_type": "mlp", "input": 200, "layers": [{"linear": 100}, "relu", {"linear": 200}, "sigmoid"]}
_LLAMA = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "tie_word_embeddings": False}

# name, config, batch, seq, precision, bucket_cap_mb (None: DDP's default), find_unused_parameters, freeze globs
GRID = [
    ("nanogpt-default-cap", _NANO, 2, 8, "fp32", None, False, []),
    ("nanogpt-cap-0.01", _NANO, 2, 8, "fp32", 0.01, False, []),
    ("nanogpt-cap-0.01-unused", _NANO, 2, 8, "fp32", 0.01, True, []),
    ("nanogpt-big-default-cap", _NANO_BIG, 1, 8, "fp32", None, False, []),
    ("nanogpt-big-default-unused", _NANO_BIG, 1, 8, "fp32", None, True, []),
    ("nanogpt-cap-0.01-amp", _NANO, 2, 8, "bf16-amp", 0.01, False, []),
    ("nanogpt-cap-0.02-frozen", _NANO, 2, 8, "fp32", 0.02, False, ["transformer.h.0.*"]),
    ("gpt2-tied-cap-0.02", _GPT2, 2, 8, "fp32", 0.02, False, []),
    ("gpt2-tied-cap-0.02-bf16", _GPT2, 2, 8, "bf16", 0.02, False, []),
    ("gpt2-untied-cap-0.05-amp", _GPT2_UNTIED, 2, 8, "bf16-amp", 0.05, False, []),
    ("gpt2-untied-cap-0.05-unused", _GPT2_UNTIED, 2, 8, "fp32", 0.05, True, []),
    ("llama-cap-0.03", _LLAMA, 2, 8, "fp32", 0.03, False, []),
    ("llama-cap-0.03-unused-bf16", _LLAMA, 2, 8, "bf16", 0.03, True, []),
    ("mlp-cap-0.05", _MLP, 3, 8, "fp32", 0.05, False, []),
]


def _ints(text):
    return [int(x) for x in re.findall(r"\d+", text or "")]


def _groups(text):
    """'3 2, 1 0' -> [[3, 2], [1, 0]] (rebuilt_per_bucket_param_indices)."""
    return [_ints(g) for g in (text or "").split(",") if g.strip()]


def measure_ddp(cfg, batch, seq, precision, cap_mb, find_unused, freeze):
    dtype, autocast_dtype = measure.PRECISIONS[precision]
    torch.manual_seed(0)
    model = models.build_model(models.zero_dropout(cfg), frozen=freeze, checkpointing="none", checkpoint_every=1)
    if dtype != torch.float32:
        model.to(dtype)
    model.train()
    # torch 2.x's first bucket with an explicit bucket_cap_mb (see the module docstring)
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(cap_mb * 1024 * 1024) if cap_mb is not None else 1024 * 1024
    kwargs = {"find_unused_parameters": find_unused}
    if cap_mb is not None:
        kwargs["bucket_cap_mb"] = cap_mb
    sync = torch.nn.parallel.distributed._sync_module_states
    if dtype == torch.bfloat16:
        # gloo has no bfloat16 collectives ("Invalid scalar type"): with one rank the construction broadcast and
        # the all-reduce change nothing, so the broadcast is skipped and a no-op comm hook stands in for the
        # all-reduce (neither decides the buckets)
        torch.nn.parallel.distributed._sync_module_states = lambda *a, **k: None
        kwargs["broadcast_buffers"] = False  # the per-forward buffer broadcast too
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    finally:
        torch.nn.parallel.distributed._sync_module_states = sync
    if dtype == torch.bfloat16:
        def noop(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        ddp.register_comm_hook(None, noop)
    initial = _ints(ddp._get_ddp_logging_data().get("bucket_sizes"))
    g = torch.Generator().manual_seed(1)
    if getattr(model, "is_stack", False):
        inputs = [torch.randn(batch, model.input_features, generator=g).to(dtype)]
    else:
        ids = torch.randint(0, model.vocab_size, (batch, seq), dtype=torch.int64, generator=g)
        inputs = [ids, torch.randint(0, model.vocab_size, (batch, seq), dtype=torch.int64, generator=g)]
    for it in range(3):  # the third forward rebuilds the buckets
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = ddp(*inputs)
        if it < 2:
            loss.backward()
            for p in model.parameters():
                p.grad = None  # zero_grad(set_to_none=True)
    data = ddp._get_ddp_logging_data()
    rebuilt = _ints(data.get("rebuilt_bucket_sizes")) if data.get("has_rebuilt_buckets") else []
    rebuilt_params = _groups(data.get("rebuilt_per_bucket_param_indices")) if rebuilt else []
    dist._DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
    return initial, rebuilt, rebuilt_params


def run_trainmem(binary, path, cfg, batch, seq, precision, cap_mb, find_unused, freeze):
    mt = cfg["model_type"]
    impl = "stack" if mt == "mlp" else "nanogpt" if mt == "nanogpt" else "hf"
    cmd = [binary, "estimate", "--model", path, "--impl", impl, "--batch", str(batch), "--seq", str(seq),
           "--precision", precision, "--dp", "2", "--steps", "2", "--format", "json",
           "--find-unused-parameters", "true" if find_unused else "false",
           "--torch", "1.13" if cap_mb is None else "2.9"]
    if mt != "mlp":
        cmd += ["--attention", "eager"]
    if cap_mb is not None:
        cmd += ["--bucket-cap-mb", str(cap_mb)]
    for f in freeze:
        cmd += ["--freeze", f]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()}")
    d = json.loads(p.stdout)["ddp"]
    return d["initial_bucket_bytes"], d["rebuilt_bucket_bytes"], d["rebuilt_bucket_params"]


def main(argv=None):
    binary = inference.trainmem_argument(argv, __doc__)
    store = tempfile.NamedTemporaryFile(prefix="trainmem-ddp-store-", delete=False)
    store.close()
    os.unlink(store.name)
    dist.init_process_group("gloo", init_method="file://" + store.name, rank=0, world_size=1)
    failures = 0
    try:
        for (name, cfg, batch, seq, prec, cap, unused, freeze), path in inference.each_config(GRID, "trainmem-ddp-"):
            want = measure_ddp(cfg, batch, seq, prec, cap, unused, freeze)
            got = run_trainmem(binary, path, cfg, batch, seq, prec, cap, unused, freeze)
            ok = list(want) == list(got)
            failures += not ok
            print(f"{name:30s} buckets {want[0]} / {got[0]}  rebuilt {want[1]} / {got[1]}"
                  f"{'' if want[2] == got[2] else f'  order {want[2]} / {got[2]}'}  {'ok' if ok else 'FAIL'}")
    finally:
        dist.destroy_process_group()
    print(f"{len(GRID)} DDP configurations (measured / trainmem): {len(GRID) - failures} ok, {failures} failing")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
