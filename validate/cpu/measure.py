#!/usr/bin/python3
"""One real training step on CPU (PyTorch, Debian's /usr/bin/python3), reporting device-independent
quantities for trainmem to be checked against.

    /usr/bin/python3 validate/cpu/measure.py --config PATH.json [--set key=value ...] --batch B --seq T \
        --precision fp32|bf16 [--optimizer adamw|sgd|sgd-momentum|none] [--dropout-off] [--keep-dropout] \
        [--no-tensors]

Prints one JSON object. In-process use: measure(config, batch, seq, precision, optimizer) -> dict.

What is measured:
  * forward + backward run inside torch.autograd.graph.saved_tensors_hooks(pack, unpack); pack records every
    tensor autograd saves for backward. Before backward the graph is walked from the loss and every node's
    _saved_* attributes are read, which calls unpack and tells which node (grad_fn) and field saved what.
  * saved_activation_bytes: sum over DISTINCT storages (by storage data_ptr) of the packed tensors, each storage
    counted whole (storage nbytes), excluding storages of parameters and buffers, and excluding the 0-dim
    float64/int64 "wrapped number" tensors that Python scalar operands become (x * 0.125): torch 1.13 packs
    them, but they are CPU scalars that never occupy GPU memory (reported as saved_wrapped_scalar_bytes).
  * saved_activation_bytes_cuda: the same set, corrected for the two places where CPU torch 1.13 saves
    something different from CUDA torch 2.x (see _cuda_torch2_bytes): MeanBackward1 keeps its whole input
    in 1.13 (nothing in 2.x), and LayerNorm mean/rstd are bf16 on CPU but float32 on CUDA.
  * gradients, optimizer state (after one optimizer.step()), parameter and buffer totals.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _storage_key_and_bytes(t):
    s = t.storage()
    return s.data_ptr(), s.nbytes()


def _dtype_name(dt):
    return str(dt).replace("torch.", "")


def make_optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "none":
        return None
    raise ValueError(f"unknown optimizer {name!r}")


def measure(config, batch, seq, precision="fp32", optimizer="adamw", dropout_off=True, with_tensors=True,
            seed=0):
    """Run one training step of `config` and return the measured quantities as a dict."""
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {sorted(DTYPES)}")
    dtype = DTYPES[precision]
    cfg = models.zero_dropout(config) if dropout_off else dict(config)
    torch.manual_seed(seed)
    model = models.build_model(cfg)
    if dtype != torch.float32:
        model.to(dtype)  # casts floating buffers too, as model.to(torch.bfloat16) does
    model.train()

    params = list(model.parameters())
    buffers = list(model.buffers())
    pb_storages = set()
    for t in params + buffers:
        pb_storages.add(t.storage().data_ptr())

    is_stack = getattr(model, "is_stack", False)
    g = torch.Generator().manual_seed(seed + 1)
    inputs = []
    if is_stack:
        x = torch.randn(batch, model.input_features, generator=g).to(dtype)
        inputs = [x]
    else:
        V = model.vocab_size
        ids = torch.randint(0, V, (batch, seq), dtype=torch.int64, generator=g)
        labels = torch.randint(0, V, (batch, seq), dtype=torch.int64, generator=g)
        inputs = [ids, labels]
    input_storages = {t.storage().data_ptr() for t in inputs}

    packed = []
    unpack_cb = [None]

    def pack(t):
        packed.append(t)
        return len(packed) - 1

    def unpack(idx):
        if unpack_cb[0] is not None:
            unpack_cb[0](idx)
        return packed[idx]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = model(*inputs)
    # Which node saved what: read the saved fields before backward frees them.
    owner = _walk(loss.grad_fn, unpack_cb)
    unpack_cb[0] = None
    loss_value = float(loss.detach().float())
    loss.backward()

    opt = make_optimizer(optimizer, params)
    if opt is not None:
        opt.step()

    # ---- saved tensors
    saved = []
    storage_index = {}
    for i, t in enumerate(packed):
        key, nbytes = _storage_key_and_bytes(t)
        node, field = owner.get(i, ("?", "?"))
        # A Python number used as an operand (x * 0.125) becomes a 0-dim CPU "wrapped number" tensor
        # (float64 / int64) that torch 1.13 packs; it never lives on the GPU, so it is not counted.
        wrapped = (t.dim() == 0 and t.dtype in (torch.float64, torch.int64, torch.complex128)
                   and not t.requires_grad and t.grad_fn is None)
        first = key not in storage_index
        entry = {
            "shape": list(t.shape),
            "dtype": _dtype_name(t.dtype),
            "storage_bytes": nbytes,
            "grad_fn": node,
            "field": field,
            "is_param_or_buffer": key in pb_storages,
            "is_input": key in input_storages,
            "is_wrapped_scalar": wrapped,
            "storage": storage_index.setdefault(key, len(storage_index)),
            "first_use_of_storage": first,
        }
        cuda = _cuda_torch2_bytes(node, field, t, nbytes)
        if cuda != nbytes:
            entry["cuda_torch2_bytes"] = cuda
        saved.append(entry)
    acc = _account(saved)
    # ---- optimizer state
    state_bytes = 0
    step_tensors = 0
    step_bytes = 0
    if opt is not None:
        for st in opt.state.values():
            for k, v in st.items():
                if not torch.is_tensor(v):
                    continue
                if k == "step" and v.device.type == "cpu":
                    step_tensors += 1
                    step_bytes += v.numel() * v.element_size()
                    continue
                state_bytes += v.numel() * v.element_size()

    out = {
        "model_type": cfg.get("model_type"),
        "batch": batch,
        "seq": seq,
        "precision": precision,
        "optimizer": optimizer,
        "dropout_off": dropout_off,
        "parameters": sum(p.numel() for p in params),
        "parameter_tensors": len(params),
        "weights_bytes": sum(p.numel() * p.element_size() for p in params),
        "buffers_elements": sum(b.numel() for b in buffers),
        "buffers_bytes": sum(b.numel() * b.element_size() for b in buffers),
        "gradients_bytes": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer_state_bytes": state_bytes,
        "optimizer_step_tensors": step_tensors,
        "optimizer_step_bytes": step_bytes,
        "saved_activation_bytes": acc["cpu"],
        "saved_activation_bytes_cuda": acc["cuda"],
        "saved_input_bytes": acc["input"],
        "saved_param_or_buffer_bytes": acc["param_or_buffer"],
        "saved_wrapped_scalar_bytes": acc["wrapped"],
        "saved_tensor_count": len(saved),
        "saved_storage_count": len(storage_index),
        "saved_by_grad_fn": acc["by_grad_fn"],
        "saved_by_grad_fn_cuda": acc["by_grad_fn_cuda"],
        "loss": loss_value,
        "torch": torch.__version__,
    }
    if with_tensors:
        out["saved_tensors"] = saved
    del packed
    return out


def _walk(root, unpack_cb):
    """Map pack index -> (grad_fn name, field) by reading every node's _saved_* attributes (unpack reports the
    index while the walk says which node/field is being read)."""
    owner = {}
    current = ["?", "?"]

    def cb(idx):
        if idx not in owner:
            owner[idx] = (current[0], current[1])

    unpack_cb[0] = cb
    seen = set()
    keep = []
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        name = type(node).__name__
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            current[0], current[1] = name, attr[len("_saved_"):]
            try:
                getattr(node, attr)
            except Exception:  # noqa: BLE001 - fields that cannot be read back hold no tensor
                pass
        for nxt, _ in node.next_functions:
            if nxt is not None:
                stack.append(nxt)
    return owner


def _cuda_torch2_bytes(node, field, t, nbytes):
    """Bytes this saved tensor would take in CUDA torch 2.x, where that differs from CPU torch 1.13:
      * MeanBackward1.self: torch 1.13's mean.dim formula (sum_backward(...) / _safe_size(self.sizes(), dim))
        saves the whole input; torch 2.x's (mean_backward(grad, self.sym_sizes(), dim, self.sym_numel(),
        keepdim)) saves only sizes -> 0 bytes. (RMSNorm's pow(2).mean(-1) hits this.)
      * NativeLayerNormBackward0.result1/result2 (mean, rstd): CPU torch 1.13 keeps them in the input dtype,
        CUDA computes and saves them in float32 (the accumulate type) for bf16/fp16 inputs."""
    if node == "MeanBackward1" and field == "self":
        return 0
    if node == "NativeLayerNormBackward0" and field in ("result1", "result2") and t.element_size() < 4:
        return t.numel() * 4
    return nbytes


def _account(saved):
    """Dedupe by storage (each counted once, whole) and total. A storage saved by several nodes is counted for
    CUDA if any saver that torch 2.x keeps still saves it, at the size that saver gives it."""
    by_storage = {}
    for e in saved:
        by_storage.setdefault(e["storage"], []).append(e)
    acc = {"cpu": 0, "cuda": 0, "input": 0, "param_or_buffer": 0, "wrapped": 0, "by_grad_fn": {},
           "by_grad_fn_cuda": {}}
    for entries in by_storage.values():
        e0 = entries[0]
        if e0["is_wrapped_scalar"]:
            acc["wrapped"] += e0["storage_bytes"]
            continue
        if e0["is_param_or_buffer"]:
            acc["param_or_buffer"] += e0["storage_bytes"]
            continue
        acc["cpu"] += e0["storage_bytes"]
        if e0["is_input"]:
            acc["input"] += e0["storage_bytes"]
        acc["by_grad_fn"][e0["grad_fn"]] = acc["by_grad_fn"].get(e0["grad_fn"], 0) + e0["storage_bytes"]
        kept = [e for e in entries if e.get("cuda_torch2_bytes", e["storage_bytes"]) > 0]
        if kept:
            b = max(e.get("cuda_torch2_bytes", e["storage_bytes"]) for e in kept)
            acc["cuda"] += b
            acc["by_grad_fn_cuda"][kept[0]["grad_fn"]] = acc["by_grad_fn_cuda"].get(kept[0]["grad_fn"], 0) + b
    for k in ("by_grad_fn", "by_grad_fn_cuda"):
        acc[k] = dict(sorted(acc[k].items(), key=lambda kv: -kv[1]))
    return acc


def _parse_value(v):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="config.json (transformers, nanoGPT keys, or mlp stack)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (value parsed as JSON when possible)")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--precision", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--optimizer", choices=["adamw", "sgd", "sgd-momentum", "none"], default="adamw")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--dropout-off", action="store_true", default=True,
                   help="set every dropout probability to 0 (the default)")
    g.add_argument("--keep-dropout", action="store_true", help="keep the config's dropout probabilities")
    ap.add_argument("--no-tensors", action="store_true", help="omit the per-tensor list")
    a = ap.parse_args(argv)
    with open(a.config) as f:
        cfg = json.load(f)
    for s in a.set:
        if "=" not in s:
            ap.error(f"--set expects key=value, got {s!r}")
        k, v = s.split("=", 1)
        cfg[k] = _parse_value(v)
    res = measure(cfg, a.batch, a.seq, a.precision, a.optimizer, dropout_off=not a.keep_dropout,
                  with_tensors=not a.no_tensors)
    json.dump(res, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
