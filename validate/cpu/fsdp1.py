"""The CPU oracle for trainmem --sharding fsdp1: FSDP1's FlatParameter flattening and sharding, run by PyTorch.

torch 1.13's own FlatParamHandle (torch/distributed/fsdp/flat_param.py) flattens the parameters of a decoder layer
and of the root (the embedding, the final norm, lm_head) of Llama-shaped modules built here with trainmem's
shapes, then FlatParamHandle.shard() cuts them for rank 0 of W ranks (shard() only asks the process group for
rank() and size(): a stand-in object gives them, so no gloo group is needed to get the layout). Its sharded flat
parameter's numel (S), its padded unsharded numel (W x S) and the elements of each original parameter in rank 0's
shard (_shard_param_offsets) are compared, exactly, with `trainmem estimate --dp W --sharding fsdp1 --format json`
("fsdp1": units' shard_numel, padded_unsharded_numel, flat_numel, world_padding; local_elems).

Differences between torch 1.13 (what runs here) and the 2.9 that trainmem models, checked in the source:
- 1.13's FlatParamHandle has no use_orig_params alignment: _init_flat_param concatenates the parameters as they
  are, and _get_shard pads each rank's chunk to chunks[0].numel() with F.pad (the last ranks). 2.x with
  use_orig_params=True (the Trainer's default) inserts a padding tensor before each parameter whose start is not a
  multiple of _get_aligned_numel (16 bytes / the compute dtype's size: 8 for bf16) and one at the end making the
  total divisible by W (_init_flat_param_and_metadata). Both give S = ceil(N / W) and W x S gathered when no
  parameter start needs alignment, so the rows here use sizes that are multiples of 8 (all Llama checkpoints'
  are); the alignment padding itself is checked against hand numbers in tests/unit/fsdp1_test.cc only.
- 1.13 imports torch.distributed._shard on the way to flat_param.py, which fails under Python 3.11 (a dataclass
  with a mutable default); this script loads flat_param.py with its one import of that chain
  (_fsdp_extensions: identity transforms without tensor parallelism) stubbed.
- Large rows (Llama-3-8B) run on the meta device: the layout is shapes only.

Usage:
    /usr/bin/python3 validate/cpu/fsdp1.py --trainmem build/trainmem
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import types

import torch
import torch.nn as nn


def load_flat_param():
    base = os.path.join(os.path.dirname(torch.__file__), "distributed", "fsdp")
    pkg = types.ModuleType("fsdp113")
    pkg.__path__ = [base]
    sys.modules["fsdp113"] = pkg
    ext = types.ModuleType("fsdp113._fsdp_extensions")
    ext._ext_pre_flatten_transform = lambda t: (t, None)
    ext._ext_post_unflatten_transform = lambda t, e: t
    sys.modules["fsdp113._fsdp_extensions"] = ext
    for name in ("_utils", "flat_param"):
        spec = importlib.util.spec_from_file_location(f"fsdp113.{name}", os.path.join(base, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"fsdp113.{name}"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["fsdp113.flat_param"]


class Attn(nn.Module):
    def __init__(self, c, heads, kv, d, dev):
        super().__init__()
        self.q_proj = nn.Linear(c, heads * d, bias=False, device=dev)
        self.k_proj = nn.Linear(c, kv * d, bias=False, device=dev)
        self.v_proj = nn.Linear(c, kv * d, bias=False, device=dev)
        self.o_proj = nn.Linear(heads * d, c, bias=False, device=dev)


class Mlp(nn.Module):
    def __init__(self, c, f, dev):
        super().__init__()
        self.gate_proj = nn.Linear(c, f, bias=False, device=dev)
        self.up_proj = nn.Linear(c, f, bias=False, device=dev)
        self.down_proj = nn.Linear(f, c, bias=False, device=dev)


class Norm(nn.Module):
    def __init__(self, c, dev):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c, device=dev))


class Layer(nn.Module):  # LlamaDecoderLayer's parameters in its named_parameters() order
    def __init__(self, c, f, heads, kv, d, dev):
        super().__init__()
        self.self_attn = Attn(c, heads, kv, d, dev)
        self.mlp = Mlp(c, f, dev)
        self.input_layernorm = Norm(c, dev)
        self.post_attention_layernorm = Norm(c, dev)


class Root(nn.Module):  # LlamaForCausalLM without its (separately wrapped) layers
    def __init__(self, c, v, dev):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(v, c, device=dev)
        self.model.norm = Norm(c, dev)
        self.lm_head = nn.Linear(c, v, bias=False, device=dev)


class Group:  # what FlatParamHandle.shard() asks of the process group
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def torch_layout(fp, module, world):
    params = list(module.parameters())
    cfg = fp.HandleConfig(fp.HandleShardingStrategy.FULL_SHARD, False, None, None)
    dev = params[0].device
    handle = fp.FlatParamHandle(params, module, dev, cfg)
    numel = handle.flat_param.numel()
    try:
        handle.shard(Group(0, world))
    except RuntimeError as err:
        # shard() sets the sharded flat parameter and its metadata, then frees the unsharded storage, which a meta
        # tensor cannot resize: the layout is complete by then
        if dev.type != "meta" or "meta" not in str(err):
            raise
    s = handle.flat_param.numel()
    in_shard = sum(e - b + 1 for b, e in handle.flat_param._shard_param_offsets)
    return {"params": numel, "shard": s, "padded": s * world, "rank0": in_shard}


# (name, --set overrides, hidden, intermediate, heads, kv heads, head_dim, vocab, layers, device)
ROWS = [
    ("tiny llama, vocab 1001", 64, 200, 4, 2, 16, 1001, 2, "cpu"),
    ("tiny llama, odd intermediate 344", 64, 344, 4, 1, 16, 997, 2, "cpu"),
    ("llama-3-8b shapes", 4096, 14336, 32, 8, 128, 128256, 2, "meta"),
]
WORLDS = [2, 3, 5, 6, 7, 8]


def trainmem_json(binary, c, f, heads, kv, d, v, layers, world):
    cmd = [binary, "estimate", "--model", "llama-3-8b", "--dp", str(world), "--sharding", "fsdp1", "--batch", "1",
           "--seq", "16", "--format", "json"]
    for k, val in (("hidden_size", c), ("intermediate_size", f), ("num_attention_heads", heads),
                   ("num_key_value_heads", kv), ("head_dim", d), ("vocab_size", v), ("num_hidden_layers", layers)):
        cmd += ["--set", f"{k}={val}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise SystemExit(f"trainmem failed: {' '.join(cmd)}\n{p.stderr}")
    return json.loads(p.stdout)["fsdp1"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainmem", required=True)
    args = ap.parse_args()
    fp = load_flat_param()
    bad = 0
    rows = 0
    for name, c, f, heads, kv, d, v, layers, dev in ROWS:
        for world in WORLDS:
            # new modules per world size: FlatParamHandle replaces their parameters by views of its FlatParameter
            with torch.no_grad():
                layer = Layer(c, f, heads, kv, d, torch.device(dev))
                root = Root(c, v, torch.device(dev))
            for n in [p.numel() for p in layer.parameters()] + [p.numel() for p in root.parameters()]:
                assert n % 8 == 0, f"{name}: {n} is not a multiple of 8 (2.x alignment would differ)"
            want_layer = torch_layout(fp, layer, world)
            want_root = torch_layout(fp, root, world)
            got = trainmem_json(args.trainmem, c, f, heads, kv, d, v, layers, world)
            units = {u["name"]: u for u in got["units"]}
            checks = []
            for unit, want in (("model.layers.0", want_layer), ("model (root)", want_root)):
                u = units[unit]
                checks += [(f"{unit} params", u["params"], want["params"]),
                           (f"{unit} shard S", u["shard_numel"], want["shard"]),
                           (f"{unit} W x S", u["padded_unsharded_numel"], want["padded"]),
                           (f"{unit} padding", u["align_padding"] + u["world_padding"], want["padded"] - want["params"])]
            checks.append(("rank 0 parameter elements", got["local_elems"],
                           layers * want_layer["rank0"] + want_root["rank0"]))
            for what, g, w in checks:
                rows += 1
                ok = g == w
                bad += 0 if ok else 1
                print(f"{'ok ' if ok else 'BAD'} {name}, W={world}: {what}: trainmem {g:,} torch {w:,}")
    print(f"{rows - bad}/{rows} exact")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
