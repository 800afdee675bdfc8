#!/usr/bin/env python3
"""What torchtitan's selective activation checkpointing keeps, from the real op stream of torch 1.13 (CPU).

torch 1.13 has no create_selective_checkpoint_contexts (torch >= 2.4), so this does not run SAC: it runs one
real forward of the reference models (models.py, eager attention, float32, dropout 0) under a TorchDispatchMode
that sees the ATen ops the dispatcher really runs below autograd (nn.Linear -> t + mm / addmm, torch.matmul of
batched operands -> bmm, ...) and applies torchtitan's SelectiveAC policy (torchtitan/distributed/
activation_checkpoint.py, SelectiveAC._wrap_block's wrapped_policy, torchtitan b5bcd76) to each decoder layer's
ops: an op of the save set (torch._functorch.partitioners.get_default_op_list().compute_intensive_ops: mm, bmm,
addmm, the sdpa flash/efficient ops, ...) is MUST_SAVE, except every second aten.mm of the layer (the counter is
per checkpoint call). The bytes of the outputs the policy saves are what _CachingTorchDispatchMode keeps
(storage[func].append(detach(out)): the same storages) from forward to the recompute; non-reentrant
checkpointing keeps the layer inputs besides, as full checkpointing does. So

    kept = saved_activations(--checkpointing selective) - saved_activations(--checkpointing full, non-reentrant)

in `trainmem estimate`, which this script compares, exactly, for a few configurations.

    /usr/bin/python3 validate/cpu/sac_ops.py --trainmem build/trainmem
"""

import argparse
import json
import os
import subprocess
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
aten = torch.ops.aten

# get_default_op_list().compute_intensive_ops (torch/_functorch/partitioners.py) as torchtitan takes them
# (op.default), of those torch 1.13 has; torchtitan adds aten.linear, max, topk and ops no model here runs.
SAVE_OPS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.convolution.default,
            aten.upsample_bilinear2d.default, aten.max.default, aten.topk.default}
MM_OPS = {aten.mm.default}  # aten.linear decomposes into mm/addmm before the mode sees it (CompositeImplicit)


class SelectivePolicy(TorchDispatchMode):
    """Applies the policy to the ops of the layer being run (`layer` is not None) and keeps what it saves."""

    def __init__(self):
        super().__init__()
        self.layer = None
        self.mm_count = 0
        self.kept = {}  # storage identity -> (bytes, op, layer, the output: kept alive as SAC's storage does)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.layer is None or func not in SAVE_OPS:
            return out
        if func in MM_OPS:
            self.mm_count += 1
            if self.mm_count % 2 == 0:  # every second mm: PREFER_RECOMPUTE
                return out
        for t in tree_flatten(out)[0]:
            if torch.is_tensor(t):
                key, _ = models.storage_id(t)
                self.kept.setdefault(key, (t.storage().nbytes(), str(func), self.layer, t))
        return out


def oracle_kept(config, batch, seq):
    model = models.build_model(config)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    mode = SelectivePolicy()
    plain_call_layer = models.call_layer

    def call_layer(settings, index, layer, *args, **kwargs):
        # one checkpoint call per decoder layer: a fresh policy closure (torchtitan's context_fn)
        mode.layer, mode.mm_count = index, 0
        try:
            return plain_call_layer(settings, index, layer, *args, **kwargs)
        finally:
            mode.layer = None

    models.call_layer = call_layer
    hooks = []
    if config.get("model_type") == "nanogpt":  # GPT.forward calls `x = block(x)` itself, not call_layer
        for i, block in enumerate(model.transformer.h):
            def enter(_m, _args, i=i):
                mode.layer, mode.mm_count = i, 0

            def leave(_m, _args, _out):
                mode.layer = None

            hooks += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    try:
        ids = torch.randint(0, 100, (batch, seq))
        with mode:
            if config.get("model_type") == "nanogpt":
                model(ids, ids)
            else:
                model(input_ids=ids, labels=ids)
    finally:
        models.call_layer = plain_call_layer
        for h in hooks:
            h.remove()
    return sum(b for b, _, _, _ in mode.kept.values()), sorted({(l, op) for _, op, l, _ in mode.kept.values()})


def trainmem_saved(exe, path, overrides, batch, seq, mode):
    cmd = [exe, "estimate", "--model", path, "--attention", "eager", "--precision", "fp32", "--batch", str(batch),
           "--seq", str(seq), "--checkpointing", mode, "--checkpoint-reentrant", "false", "--format", "json"]
    for o in overrides:
        cmd += ["--set", o]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(p.stdout)["memory"]["saved_activations_bytes"]


CONFIGS = [  # (config file, overrides): Conv1D addmm; bias-free linears (mm); nanoGPT without biases
    ("data/models/gpt2.json", ["n_layer=2"]),
    ("data/models/tinyllama-1.1b.json", ["num_hidden_layers=2"]),
    ("data/models/qwen2-0.5b.json", ["num_hidden_layers=2"]),
    ("data/models/nanogpt-gpt2.json", ["n_layer=2"]),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainmem", required=True)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    a = ap.parse_args()
    torch.manual_seed(0)
    failed = 0
    for path, overrides in CONFIGS:
        with open(os.path.join(ROOT, path)) as f:
            cfg = json.load(f)
        for o in overrides:
            k, v = o.split("=")
            cfg[k] = int(v)
        kept, ops = oracle_kept(cfg, a.batch, a.seq)
        predicted = (trainmem_saved(a.trainmem, os.path.join(ROOT, path), overrides, a.batch, a.seq, "selective")
                     - trainmem_saved(a.trainmem, os.path.join(ROOT, path), overrides, a.batch, a.seq, "full"))
        ok = kept == predicted
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {os.path.basename(path)} {' '.join(overrides)}: kept {kept:,} B by the "
              f"policy on torch {torch.__version__}'s ops, trainmem {predicted:,} B; saved ops: "
              f"{sorted({op for _, op in ops})}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
