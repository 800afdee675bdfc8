#!/usr/bin/python3
"""One real training step on CPU (PyTorch, Debian's /usr/bin/python3), reporting device-independent
quantities for trainmem to be checked against.

    /usr/bin/python3 validate/cpu/measure.py --config PATH.json [--set key=value ...] --batch B --seq T \
        --precision fp32|bf16|bf16-amp [--optimizer adamw|sgd|sgd-momentum|adafactor|adafactor-torch|none] [--dropout-off] [--keep-dropout] \
        [--freeze GLOB ...] [--checkpointing none|full] [--checkpoint-reentrant true|false] \
        [--checkpoint-every N] [--lora SPEC] [--lora-dtype fp32|base] [--input-require-grads true|false] \
        [--autocast] [--no-tensors]

Prints one JSON object. In-process use: measure(config, batch, seq, precision, optimizer, freeze=[...],
checkpointing="full", checkpoint_reentrant=True, checkpoint_every=1, lora="r=16,alpha=32,targets=q_proj+v_proj",
lora_dtype="fp32", enable_input_require_grads=None) -> dict. precision: fp32 | bf16 | bf16-amp.

What is measured:
  * forward runs inside torch.autograd.graph.saved_tensors_hooks(pack, unpack) and a TorchDispatchMode
    (_StorageRegistry) that keeps a C++ weak reference to every storage an ATen op returns. pack records
    every tensor autograd saves and hands the SavedVariable a small object holding it, to which measure keeps
    only a weak reference: a saved tensor counts when its SavedVariable still exists at the end of forward.
    Before backward the graph is walked from the loss and every node's _saved_* attributes (and a custom
    Function's ctx.saved_tensors) are read, which calls unpack and tells which node (grad_fn) and field saved
    what. Nodes inside non-reentrant checkpoint regions are not read (that would run the recomputation).
  * at the end of forward (after gc.collect()), every storage made during forward that is still alive is
    either held by a SavedVariable, or kept by a checkpoint (a positional input: CheckpointFunction saves it;
    torch 1.13's non-reentrant checkpoint keeps it in its unpack closure; or a keyword argument riding in the
    partial), or it is "unexplained" (an oracle error; none occurs).
  * saved_activation_bytes: sum over DISTINCT storages (by StorageImpl) of the tensors live SavedVariables hold
    plus the checkpoint inputs, each storage counted whole (storage nbytes), excluding storages of parameters
    and buffers, and excluding the 0-dim float64/int64 "wrapped number" tensors that Python scalar operands
    become (x * 0.125): torch 1.13 packs them, but they are CPU scalars that never occupy GPU memory (reported
    as saved_wrapped_scalar_bytes). The partial's keyword arguments are not included (end_of_forward reports
    them: checkpoint_kwarg_bytes_cuda, and live_bytes_cuda with them).
  * saved_activation_bytes_cuda: the same set, corrected for the two places where CPU torch 1.13 saves
    something different from CUDA torch 2.x (see _cuda_torch2_bytes): MeanBackward1 keeps its whole input
    in 1.13 (nothing in 2.x), and LayerNorm mean/rstd are bf16 on CPU but float32 on CUDA.
  * gradients (only the parameters that got a .grad), optimizer state (after one optimizer.step() over the
    trainable parameters), parameter, trainable-parameter and buffer totals.
"""

import argparse
import gc
import json
import os
import sys
import warnings
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
import live as live_timeline  # noqa: E402
import optimizers  # noqa: E402
import peft_lora  # noqa: E402
import tp_shard  # noqa: E402
import ep_shard  # noqa: E402
import torchtune_loss  # noqa: E402

# precision -> (weight dtype, autocast dtype or None). bf16-amp: float32 weights, forward under
# torch.autocast("cpu", dtype=torch.bfloat16) (trainmem --precision bf16-amp).
PRECISIONS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
              "bf16-amp": (torch.float32, torch.bfloat16)}
DTYPES = {k: v[0] for k, v in PRECISIONS.items()}


def _dtype_name(dt):
    return str(dt).replace("torch.", "")


def make_optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "adafactor":  # transformers' Trainer optim="adafactor": scale_parameter=False, relative_step=False
        return optimizers.TransformersAdafactor(params, lr=1e-3, scale_parameter=False, relative_step=False)
    if name == "adafactor-torch":  # torch.optim.Adafactor (2.5+) defaults, foreach=None: single-tensor path
        return optimizers.TorchAdafactor(params)
    if name == "none":
        return None
    raise ValueError(f"unknown optimizer {name!r}")


class _Packed:
    """What pack returns, so what a SavedVariable holds: the tensor, and the pack index. Only the SavedVariable
    owns it (measure keeps a weak reference), so it is alive exactly while autograd still holds that saved
    tensor: a node that is dropped (a branch the loss does not use) releases it."""

    __slots__ = ("idx", "t", "__weakref__")

    def __init__(self, idx, t):
        self.idx = idx
        self.t = t


class _StorageRegistry(TorchDispatchMode):
    """Every storage an ATen op returns while the mode is active, held by a C++ weak reference
    (StorageWeakRef: a weak_intrusive_ptr to the StorageImpl). It expires exactly when the last strong owner (a
    tensor, a SavedVariable, a Python closure or ctx attribute holding a tensor) lets go, and the StorageImpl
    cannot be reused while the weak reference exists, so `expired()` is exact. The mode sits below autograd, so it
    also sees the intermediates of composite ops (cross_entropy's log_softmax, matmul's reshape copies) and the
    ops that run under no_grad inside a reentrant checkpoint."""

    def __init__(self):
        super().__init__()
        self.rows = {}
        self.bernoulli = set()  # storages an aten.bernoulli_ filled: CPU dropout's noise (see _cuda_torch2_bytes)
        # The live timeline (see live.py): one tick per ATen op (and per mark()), the op's name, and for each
        # storage the tick whose op returned it first and the tick at which it was first seen expired.
        self.tick = 0
        self.ops = [""]
        self.spans = {}
        self.live_now = set()
        self.marks = {}
        self.in_backward = False
        self.mean_temps = set()
        self.cuda_sizes = {}
        self.accumulations = []  # (tick, storage of old_var, storage of the sum): the engine's InputBuffer adds

    def _prune(self):
        gone = [k for k in self.live_now if self.rows[k][0].expired()]
        for k in gone:
            self.spans[k][1] = self.tick
            self.live_now.discard(k)

    def mark(self, name):
        """A tick between ops (end of forward, of backward, of the optimizer step): what is alive there."""
        self.tick += 1
        self.ops.append(f"[{name}]")
        self._prune()
        self.marks[name] = self.tick

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name == "aten.detach.default" and not isinstance(args[0], torch.Tensor):
            # torch 1.13: a wrapped number (a Python scalar operand that a SavedVariable unpacks in backward) reaches
            # a Python mode as a float, and detach of it cannot run (nor may the mode return a float: "detach
            # returned invalid type float"). A 0-dim CPU tensor of the same value serves: it never requires grad,
            # is never written to, and is made here, where the mode is off, so it is not registered.
            return torch.tensor(args[0])
        out = func(*args, **(kwargs or {}))
        if name == "aten.detach.default" and not isinstance(out, torch.Tensor):
            return torch.tensor(out)
        # The op's inputs are still referenced (args) and its outputs exist: live bytes now are the op's
        # outputs plus everything that survived since the previous op. Frees between two ops (a SavedVariable
        # released after its node ran, a Python temporary dropped) are seen at the next tick.
        self.tick += 1
        self.ops.append(name)
        self._prune()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.storage()
                ref = StorageWeakRef(st)
                if ref.cdata not in self.rows:
                    self.rows[ref.cdata] = (ref, ref.cdata, st.nbytes(), name, list(t.shape),
                                            _dtype_name(t.dtype))
                    self.spans[ref.cdata] = [self.tick, None]
                    self.live_now.add(ref.cdata)
                if name.startswith("aten.bernoulli_"):
                    self.bernoulli.add(ref.cdata)
        if name == "aten.native_layer_norm.default" and isinstance(out, (tuple, list)):
            # mean and rstd: the input dtype on CPU torch 1.13, float32 on CUDA for 16-bit inputs (_cuda_torch2_bytes);
            # noted per op so that a checkpoint's recomputation in backward is corrected too
            for t in out[1:3]:
                if isinstance(t, torch.Tensor) and t.element_size() < 4:
                    self.cuda_sizes[StorageWeakRef(t.storage()).cdata] = t.numel() * 4
        if name.startswith("aten.mean") and torch.is_grad_enabled() and isinstance(args[0], torch.Tensor):
            # RMSNorm's hidden_states.pow(2).mean(-1, keepdim=True): torch 1.13's MeanBackward1 keeps the pow
            # result (a temporary nothing else holds); torch 2.x saves no tensor there (_cuda_torch2_bytes). Noted
            # here too because a checkpoint's recomputation in backward makes such temporaries after the saved
            # tensors were read.
            key = StorageWeakRef(args[0].storage()).cdata
            span = self.spans.get(key)
            if span is not None and span[0] == self.tick - 1 and self.rows[key][3].startswith("aten.pow"):
                self.mean_temps.add(key)
        if (name == "aten.add.Tensor" and self.in_backward and not torch.is_grad_enabled()
                and isinstance(args[0], torch.Tensor) and isinstance(args[1], torch.Tensor)):
            # With grad mode off inside backward, the only add.Tensor is the engine's InputBuffer accumulating two
            # gradients for one input (no derivative formula of the modelled ops calls add; a checkpoint's
            # recomputation runs with grad mode on). torch 1.13 adds out of place (input_buffer.cpp:
            # buffer[pos] = old_var + var); torch 2.x adds into old_var when the buffer holds its last reference
            # (can_accumulate_inplace). live.build applies the 2.x rule. Not when old_var is a view: its base
            # (held by the view's ViewInfo) is a second owner of the storage, so can_accumulate_inplace's
            # `storage().use_count() == 1` fails and 2.x adds out of place too (a tied lm_head's weight
            # gradient, mm_mat2_backward's .t(): the H100 trace of HF GPT-2 fp32 shows the new sum).
            if not args[0]._is_view():
                self.accumulations.append((self.tick, StorageWeakRef(args[0].storage()).cdata,
                                           StorageWeakRef(out.storage()).cdata))
        return out

    def live(self):
        """(storage id, nbytes, op, shape, dtype) of every registered storage still alive."""
        return [row[1:] for row in self.rows.values() if not row[0].expired()]


def measure(config, batch, seq, precision="fp32", optimizer="adamw", dropout_off=True, with_tensors=True,
            seed=0, freeze=(), checkpointing="none", checkpoint_reentrant=True, checkpoint_every=1, lora=None,
            lora_dtype="fp32", enable_input_require_grads=None, autocast=False, loss="ce", loss_chunks=8,
            logits_to_keep=0, moe_routing="balanced", moe_experts="eager", target_seq=0, tp=1, ep=1):
    """Run one training step of `config` and return the measured quantities as a dict.

    freeze: parameter-name globs to freeze (requires_grad=False). checkpointing: "none" | "full" (every
    checkpoint_every-th decoder layer through torch.utils.checkpoint.checkpoint, use_reentrant=checkpoint_reentrant,
    as transformers' GradientCheckpointingLayer calls it). lora: None, a dict (peft_lora.parse_lora_spec's keys) or a
    spec string "r=16,alpha=32,dropout=0.05,targets=q_proj+v_proj": PEFT LoRA (peft_lora.apply_lora) applied after
    the cast to the precision's weight dtype, as get_peft_model on a model loaded in that dtype; lora_dtype "fp32"
    (autocast_adapter_dtype=True, PEFT's default) or "base" (False: the adapters keep the base weights' dtype).
    enable_input_require_grads: transformers' forward hook on the input embeddings (trainmem --input-require-grads);
    None: on for LoRA with checkpointing, as PeftModel.__init__ does it when the model is already gradient-checkpointed
    (trainmem's default too). precision "bf16-amp": float32
    weights, forward under torch.autocast("cpu", bfloat16); autocast=True runs a "bf16" (cast) model under
    autocast too (a bf16 base under Trainer(bf16=True); trainmem has no precision name for it). moe_routing: the
    experts every router picks (models.set_moe_routing), trainmem's --moe-routing balanced | worst. moe_experts:
    experts_implementation eager | grouped_mm (models.set_moe_experts), trainmem's --moe-experts."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}")
    if checkpointing not in ("none", "full"):
        raise ValueError("checkpointing must be 'none' or 'full'")
    if lora_dtype not in ("fp32", "base"):
        raise ValueError("lora_dtype must be 'fp32' or 'base'")
    if isinstance(lora, str):
        lora = peft_lora.parse_lora_spec(lora)
    elif lora is not None:
        lora = {**peft_lora.LORA_DEFAULTS, **lora}
    if lora is not None and freeze:
        raise ValueError("--freeze with --lora: PEFT already freezes every base parameter")
    if enable_input_require_grads is None:
        enable_input_require_grads = lora is not None and checkpointing != "none"
    gc.freeze()  # objects made before this call are not scanned by the collection at the end of forward
    gc.disable()  # no collection at a random op: the live timeline frees by reference counting only
    try:
        return _measure(config, batch, seq, precision, optimizer, dropout_off, with_tensors, seed, freeze,
                        checkpointing, checkpoint_reentrant, checkpoint_every, lora, lora_dtype,
                        enable_input_require_grads, autocast, loss, loss_chunks, logits_to_keep, moe_routing,
                        moe_experts, target_seq, tp, ep)
    finally:
        gc.enable()
        gc.unfreeze()


def _measure(config, batch, seq, precision, optimizer, dropout_off, with_tensors, seed, freeze, checkpointing,
             checkpoint_reentrant, checkpoint_every, lora, lora_dtype, enable_input_require_grads, autocast,
             loss="ce", loss_chunks=8, logits_to_keep=0, moe_routing="balanced", moe_experts="eager", target_seq=0,
             tp=1, ep=1):
    dtype, autocast_dtype = PRECISIONS[precision]
    if autocast and autocast_dtype is None:
        autocast_dtype = torch.bfloat16
    cfg = models.zero_dropout(config) if dropout_off else dict(config)
    ck_mode = "none" if checkpointing == "none" else ("reentrant" if checkpoint_reentrant else "non-reentrant")
    torch.manual_seed(seed)
    model = models.build_model(cfg, frozen=freeze, checkpointing=ck_mode, checkpoint_every=checkpoint_every)
    models.set_moe_routing(model, batch * seq, moe_routing)  # MoE routers: trainmem's routing assumption
    models.set_moe_experts(model, moe_experts)  # MoE experts: trainmem's --moe-experts
    model.logits_to_keep = int(logits_to_keep)  # models.keep_logits: the head and the loss over the last N positions
    if tp > 1:  # rank 0 of transformers' tensor parallelism (tp_shard.py), as loaded: before the dtype cast
        tp_shard.apply_tp(model, int(tp))
    if ep > 1:  # rank 0 of transformers' expert parallelism (ep_shard.py; tp = ep): the experts, router hooks
        ep_shard.apply_ep(model, int(ep))
    if dtype != torch.float32:
        model.to(dtype)  # casts floating buffers too, as model.to(torch.bfloat16) does; keeps requires_grad
    model.train()
    if loss == "chunked":  # torchtune's chunked output head + CEWithChunkedOutputLoss (torchtune_loss.py)
        torchtune_loss.use_chunked_loss(model, loss_chunks)
    lora_info = None
    if lora is not None:
        # get_peft_model on the model as loaded (already in its dtype): the adapters are made, cast to the base
        # dtype, and upcast to float32 unless lora_dtype == "base" (autocast_adapter_dtype=False)
        model = peft_lora.apply_lora(model, r=lora["r"], alpha=lora["alpha"], dropout=lora["dropout"],
                                     targets=lora["targets"], adapter_dtype_fp32=(lora_dtype == "fp32"),
                                     enable_input_require_grads_hook=enable_input_require_grads)
        model.train()
        lora_info = dict(model.lora_info)
        lora_info["lora_dtype"] = lora_dtype
    elif enable_input_require_grads:
        peft_lora.enable_input_require_grads(model, cfg.get("model_type"))

    params = list(model.parameters())
    buffers = list(model.buffers())
    trainable = [p for p in params if p.requires_grad]
    pb_storages = set()
    for t in params + buffers:
        pb_storages.add(models.storage_id(t)[0])

    is_stack = getattr(model, "is_stack", False)
    g = torch.Generator().manual_seed(seed + 1)
    inputs = []
    if is_stack:
        x = torch.randn(batch, model.input_features, generator=g).to(dtype)
        inputs = [x]
    elif hasattr(model, "make_inputs"):  # an encoder: the tokenizer's and collator's batch (models.BertFor*)
        inputs = model.make_inputs(batch, seq, g)
    else:
        V = model.vocab_size
        ids = torch.randint(0, V, (batch, seq), dtype=torch.int64, generator=g)
        if cfg.get("model_type") == "t5":
            # DataCollatorForSeq2Seq's batch (no model passed, so no decoder_input_ids): input_ids, attention_mask
            # (int64 ones: nothing padded), labels of target_seq tokens (trainmem --target-seq; 0: seq)
            mask = torch.ones(batch, seq, dtype=torch.int64)
            labels = torch.randint(0, V, (batch, target_seq or seq), dtype=torch.int64, generator=g)
            inputs = [ids, mask, labels]
        else:
            labels = torch.randint(0, V, (batch, seq), dtype=torch.int64, generator=g)
            inputs = [ids, labels]
    input_storages = {models.storage_id(t)[0] for t in inputs}

    packed = []       # metadata of every packed tensor, by pack index (no tensor: nothing kept alive here)
    packed_refs = []  # weakref to the _Packed object the SavedVariable holds
    unpack_cb = [None]

    def pack(t):
        idx = len(packed)
        st = t.storage()
        key, ref = models.storage_id(t)
        packed.append({
            "shape": list(t.shape), "dim": t.dim(), "dtype": t.dtype, "numel": t.numel(),
            "element_size": t.element_size(), "storage_key": key, "storage_ref": ref, "storage_bytes": st.nbytes(),
            "wrapped": (t.dim() == 0 and t.dtype in (torch.float64, torch.int64, torch.complex128)
                        and not t.requires_grad and t.grad_fn is None),
        })
        obj = _Packed(idx, t)
        packed_refs.append(weakref.ref(obj))
        return obj

    def unpack(obj):
        if unpack_cb[0] is not None:
            unpack_cb[0](obj.idx)
        return obj.t

    settings = model.checkpoint_settings
    settings.log = [] if ck_mode != "none" else None
    registry = _StorageRegistry()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            with registry:
                if autocast_dtype is not None:
                    # the autocast weight-cast cache is cleared when the outermost autocast exits, before the
                    # end-of-forward accounting below (as a training loop leaves autocast before backward)
                    with torch.autocast("cpu", dtype=autocast_dtype):
                        loss = model(*inputs)
                else:
                    loss = model(*inputs)
        # ---- end of forward: what is still alive. Collect reference cycles first, so that only what is
        # reachable counts (the objects that predate this measurement are frozen out of the scan: fast).
        gc.collect()
        registry.mark("end of forward")
        alive_packed = [r() is not None for r in packed_refs]
        live = registry.live()
        log = settings.log or []
        settings.log = None
        # Which node saved what: read the saved fields before backward frees them. The nodes of a non-reentrant
        # checkpoint region are not read: their saved fields hold the checkpoint's holders, and reading one
        # would run the region's recomputation.
        skip, pin = _checkpoint_region_nodes(log)
        leaves = []  # AccumulateGrad nodes of leaves that are not parameters (enable_input_require_grads)
        owner = _walk(loss.grad_fn, unpack_cb, skip, leaves=leaves, params=params)
        del pin
        leaf_storages = {models.storage_id(n.variable)[0] for n in leaves}
        for rec in log:
            rec.pop("output_grad_fn", None)
            rec.pop("input_grad_fns", None)
            for r in rec["args"] + rec["kwargs"]:
                r["storage_ref_"] = r.pop("storage_ref")  # kept (weak) until the accounting is done
        unpack_cb[0] = None
        loss_value = float(loss.detach().float())
        loss_storage = models.storage_id(loss)[0]
        kept = getattr(model, "kept_output", None)  # the layer stack's output, which the script keeps bound
        kept_storage = models.storage_id(kept)[0] if kept is not None else None
        del kept
        backward_error = None
        if loss.requires_grad:
            registry.in_backward = True
            with registry:
                loss.backward()
            registry.in_backward = False
        else:
            # what loss.backward() raises: every trainable parameter sits in reentrant checkpoints whose inputs do not
            # require grad (LoRA without enable_input_require_grads), and nothing after them is trainable
            backward_error = "element 0 of tensors does not require grad and does not have a grad_fn"
        leaf_grad_bytes = sum(n.variable.grad.numel() * n.variable.grad.element_size() for n in leaves
                              if n.variable.grad is not None)
        leaf_rows = [{"shape": list(n.variable.shape), "dtype": _dtype_name(n.variable.dtype),
                      "storage_bytes": n.variable.storage().nbytes()} for n in leaves]
        # nothing of the harness keeps the graph's leaves, nor the loss, past backward (`model(x).loss.backward()`,
        # trainmem --loop plain)
        del leaves
        del loss
        registry.mark("end of backward")
    warning_texts = sorted({str(w.message) for w in caught})

    opt = make_optimizer(optimizer, trainable)
    if opt is not None:
        with registry:
            opt.step()
        registry.mark("end of optimizer step")

    # ---- saved tensors (held by a SavedVariable at the end of forward)
    saved = []
    storage_index = {}
    packed_keys = set()
    for i, m in enumerate(packed):
        if not alive_packed[i]:
            continue  # its node is gone: autograd does not hold it at the end of forward
        key, nbytes = m["storage_key"], m["storage_bytes"]
        packed_keys.add(key)
        node, field = owner.get(i, ("?", "?"))
        # A Python number used as an operand (x * 0.125) becomes a 0-dim CPU "wrapped number" tensor
        # (float64 / int64) that torch 1.13 packs; it never lives on the GPU, so it is not counted. A 0-dim
        # int64 that an op returned (torchtune's total_elements = (labels != -100).sum()) is a real tensor.
        wrapped = m["wrapped"] and key not in registry.rows
        first = key not in storage_index
        entry = {
            "shape": m["shape"],
            "dtype": _dtype_name(m["dtype"]),
            "storage_bytes": nbytes,
            "grad_fn": node,
            "field": field,
            "is_param_or_buffer": key in pb_storages,
            "is_input": key in input_storages,
            "is_wrapped_scalar": wrapped,
            "storage": storage_index.setdefault(key, len(storage_index)),
            "first_use_of_storage": first,
        }
        cuda = _cuda_torch2_bytes(node, field, m, nbytes, key in registry.bernoulli)
        if cuda != nbytes:
            entry["cuda_torch2_bytes"] = cuda
        saved.append(entry)

    # ---- storages made during forward, alive at its end, that no SavedVariable holds: what a checkpoint keeps
    # (reentrant: the partial's kwargs on ctx.run_function; non-reentrant: the args and kwargs its unpack closure
    # refers to), or anything else (reported as unexplained; none is expected)
    ck_role = {}
    for rec in log:
        for r in rec["args"]:
            ck_role.setdefault(r["storage"], ("checkpoint_input", r["name"], rec["layer"]))
        for r in rec["kwargs"]:
            ck_role.setdefault(r["storage"], ("checkpoint_kwarg", r["name"], rec["layer"]))
    held = []
    live_keys = set()
    unexplained = []
    for key, nbytes, op, shape, dt in live:
        # parameters and buffers; the model inputs (the harness holds them: they count only where a SavedVariable
        # holds them, e.g. Embedding's indices); the loss (the forward's result); empty storages
        if key in pb_storages or key in input_storages or key in (loss_storage, kept_storage) or nbytes == 0:
            continue
        live_keys.add(key)
        if key in packed_keys:
            continue
        role, name, layer = ck_role.get(key, ("unexplained", op, None))
        if role == "unexplained" and key in leaf_storages:
            # a leaf that requires grad and is no parameter (enable_input_require_grads' embeddings output): its
            # AccumulateGrad node, part of the graph, keeps it until the graph is freed. Not a saved tensor.
            role, name = "grad_leaf", "AccumulateGrad.variable"
        if role == "unexplained":
            unexplained.append({"op": op, "shape": shape, "dtype": dt, "storage_bytes": nbytes})
        held.append({
            "shape": shape, "dtype": dt, "storage_bytes": nbytes,
            "grad_fn": {"checkpoint_input": "CheckpointInput", "checkpoint_kwarg": "CheckpointKwarg",
                        "grad_leaf": "GradLeaf"}.get(role, "Unexplained"),
            "field": name if layer is None else f"{name} (layer {layer})",
            "is_param_or_buffer": False, "is_input": False, "is_wrapped_scalar": False,
            "storage": storage_index.setdefault(key, len(storage_index)), "first_use_of_storage": True,
            "held_by": role,
        })
    # Self-check the other way: every storage a live SavedVariable holds should be one an op returned during
    # forward (still alive), except wrapped scalars, parameters, buffers and the model inputs.
    not_in_registry = []
    key_of = {v: k for k, v in storage_index.items()}
    for e in saved:
        key = key_of[e["storage"]]
        if not (e["is_wrapped_scalar"] or e["is_param_or_buffer"] or e["is_input"] or key in live_keys):
            not_in_registry.append((e["grad_fn"], e["field"], e["shape"], e["dtype"]))
    # Saved activations, as trainmem defines them: what autograd's SavedVariables hold, plus the checkpoint
    # inputs (reentrant: CheckpointFunction's ctx.save_for_backward, already among the SavedVariables;
    # non-reentrant: the args its unpack closure keeps). The partial's keyword arguments (mask, cos/sin,
    # position_ids), which the checkpoint also keeps alive until the region's backward, are reported apart.
    acc = _account(saved + [e for e in held if e["held_by"] not in ("checkpoint_kwarg", "grad_leaf")])
    acc_live = _account(saved + held)
    ck_input_storages = {storage_index[k] for k, v in ck_role.items()
                         if v[0] == "checkpoint_input" and k in storage_index}
    kwarg_storages = {e["storage"] for e in held if e["held_by"] == "checkpoint_kwarg"}
    grad_leaf_storages = {e["storage"] for e in held if e["held_by"] == "grad_leaf"}
    unexplained_storages = {e["storage"] for e in held if e["held_by"] == "unexplained"}
    eof = {"live_bytes": acc_live["cpu"], "live_bytes_cuda": acc_live["cuda"],
           "autograd_saved_bytes_cuda": 0, "checkpoint_input_bytes_cuda": 0, "checkpoint_kwarg_bytes_cuda": 0,
           "grad_leaf_bytes_cuda": 0, "unexplained_bytes": 0, "unexplained": unexplained,
           "saved_not_in_registry": not_in_registry}
    for sid, (cpu_b, cuda_b) in acc_live["per_storage"].items():
        if sid in unexplained_storages:
            eof["unexplained_bytes"] += cpu_b
        elif sid in kwarg_storages:
            eof["checkpoint_kwarg_bytes_cuda"] += cuda_b
        elif sid in grad_leaf_storages:
            eof["grad_leaf_bytes_cuda"] += cuda_b
        elif sid in ck_input_storages:
            eof["checkpoint_input_bytes_cuda"] += cuda_b
        else:
            eof["autograd_saved_bytes_cuda"] += cuda_b
    saved = saved + held
    for rec in log:
        for r in rec["args"] + rec["kwargs"]:
            r.pop("storage_ref_", None)
    for m in packed:
        m.pop("storage_ref", None)
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

    # ---- the live timeline of the whole step, in CUDA torch 2.x bytes (live.py)
    by_key = {}
    for e in saved:
        by_key.setdefault(key_of.get(e["storage"]), []).append(e)
    # A storage's CUDA size where it differs (dropout's bool mask, LayerNorm's float32 mean/rstd). The saved
    # rule's 0 for MeanBackward1.self is not a size: that storage exists on CUDA too, it only dies sooner, which
    # the registry notes per op (mean_temps) for the forward and for a checkpoint's recomputation alike.
    cuda_sizes = {}
    for key, entries in by_key.items():
        size = max(e.get("cuda_torch2_bytes", e["storage_bytes"]) for e in entries)
        if any("cuda_torch2_bytes" in e for e in entries) and size > 0:
            cuda_sizes[key] = size
    step_keys = set()
    if opt is not None:
        for st in opt.state.values():
            v = st.get("step")
            if torch.is_tensor(v) and v.device.type == "cpu":
                step_keys.add(models.storage_id(v)[0])
    base_keys = pb_storages | input_storages
    base = _storage_bytes(params + buffers + inputs)
    cuda_sizes.update(registry.cuda_sizes)
    tl = live_timeline.build(registry, base_keys, cuda_sizes, registry.mean_temps, step_keys)
    live_summary = live_timeline.summary(tl, base)

    out = {
        "model_type": cfg.get("model_type"),
        "batch": batch,
        "seq": seq,
        "precision": precision,
        "optimizer": optimizer,
        "dropout_off": dropout_off,
        "freeze": list(freeze or ()),
        "checkpointing": {"mode": ck_mode, "every": int(checkpoint_every),
                          "layers": [rec["layer"] for rec in log],
                          "layers_output_requires_grad": [rec["output_requires_grad"] for rec in log]},
        "parameters": sum(p.numel() for p in params),
        "parameter_tensors": len(params),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "frozen_parameter_names": list(getattr(model, "frozen_parameters", [])),
        "lora": lora_info,
        "autocast": _dtype_name(autocast_dtype) if autocast_dtype is not None else None,
        "enable_input_require_grads": bool(enable_input_require_grads),
        "grad_leaves": leaf_rows,
        "grad_leaf_grad_bytes": leaf_grad_bytes,
        "backward_error": backward_error,
        "parameters_with_grad": sum(p.numel() for p in params if p.grad is not None),
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
        "end_of_forward": eof,
        "live_timeline": live_summary,
        "live_events": {"ticks": tl["ticks"], "allocs": tl["allocs"], "frees": tl["frees"], "marks": tl["marks"]},
        "warnings": warning_texts,
        "loss": loss_value,
        "torch": torch.__version__,
    }
    if with_tensors:
        out["live_events"]["ops"] = registry.ops
        out["saved_tensors"] = saved
        out["checkpoint_calls"] = log
        if lora_info is not None:
            out["parameter_names"] = peft_lora.lora_parameter_rows(model)
    return out


def _storage_bytes(tensors):
    """Bytes of the distinct storages of `tensors` (tied weights once)."""
    seen = {}
    for t in tensors:
        seen[models.storage_id(t)[0]] = t.storage().nbytes()
    return sum(seen.values())


def _checkpoint_region_nodes(log):
    """ids of the autograd nodes made inside non-reentrant checkpoint regions: everything reachable from a
    region's output node without passing the nodes that made its inputs. Returns (ids, pinned node objects: a
    node's Python object, hence its id, is only stable while something refers to it)."""
    skip = set()
    pin = []
    for rec in log:
        if rec["mode"] != "non-reentrant" or rec.get("output_grad_fn") is None:
            continue
        stop = {id(n) for n in rec["input_grad_fns"]}
        pin.extend(rec["input_grad_fns"])
        stack = [rec["output_grad_fn"]]
        while stack:
            node = stack.pop()
            if id(node) in skip or id(node) in stop:
                continue
            skip.add(id(node))
            pin.append(node)
            for nxt, _ in node.next_functions:
                if nxt is not None:
                    stack.append(nxt)
    return skip, pin


def _walk(root, unpack_cb, skip=frozenset(), leaves=None, params=()):
    """Map pack index -> (grad_fn name, field) by reading every node's _saved_* attributes, and a custom
    Function's ctx.saved_tensors (unpack reports the index while the walk says which node/field is being read).
    Nodes whose id is in `skip` are passed through without reading their fields. `leaves`, when a list, receives
    the AccumulateGrad nodes whose variable is not one of `params` (a leaf made to require grad, such as the input
    embeddings' output under enable_input_require_grads)."""
    param_ids = {id(p) for p in params}
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
        if leaves is not None and name == "AccumulateGrad" and id(node.variable) not in param_ids:
            leaves.append(node)
        if id(node) in skip:
            for nxt, _ in node.next_functions:
                if nxt is not None:
                    stack.append(nxt)
            continue
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            # ctx.save_for_backward of a custom Function (CheckpointFunction saves the checkpoint inputs)
            current[0], current[1] = name, "saved_tensors"
            try:
                node.saved_tensors
            except Exception:  # noqa: BLE001 - already freed
                pass
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


def _cuda_torch2_bytes(node, field, m, nbytes, bernoulli=False):
    """Bytes this saved tensor would take in CUDA torch 2.x, where that differs from CPU torch 1.13:
      * dropout with p > 0 (PEFT's lora_dropout): CPU (at::dropout -> _dropout_impl, since is_fused_kernel_acceptable
        needs CUDA) computes noise = empty_like(input).bernoulli_(1 - p).div_(1 - p) and returns input * noise, so
        MulBackward0 saves `other`, the noise, in the input dtype. CUDA runs native_dropout, whose
        NativeDropoutBackward0 saves the bool mask (result1): 1 byte per element.
      * MeanBackward1.self: torch 1.13's mean.dim formula (sum_backward(...) / _safe_size(self.sizes(), dim))
        saves the whole input; torch 2.x's (mean_backward(grad, self.sym_sizes(), dim, self.sym_numel(),
        keepdim)) saves only sizes -> 0 bytes. (RMSNorm's pow(2).mean(-1) hits this.)
      * NativeLayerNormBackward0.result1/result2 (mean, rstd): CPU torch 1.13 keeps them in the input dtype,
        CUDA computes and saves them in float32 (the accumulate type) for bf16/fp16 inputs."""
    if node == "MeanBackward1" and field == "self":
        return 0
    if node == "MulBackward0" and field == "other" and bernoulli:
        return m["numel"]  # bool mask
    if node == "NativeLayerNormBackward0" and field in ("result1", "result2") and m["element_size"] < 4:
        return m["numel"] * 4
    return nbytes


def _account(saved):
    """Dedupe by storage (each counted once, whole) and total. A storage saved by several nodes is counted for
    CUDA if any saver that torch 2.x keeps still saves it, at the size that saver gives it."""
    by_storage = {}
    for e in saved:
        by_storage.setdefault(e["storage"], []).append(e)
    acc = {"cpu": 0, "cuda": 0, "input": 0, "param_or_buffer": 0, "wrapped": 0, "by_grad_fn": {},
           "by_grad_fn_cuda": {}, "per_storage": {}}
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
        b = 0
        if kept:
            b = max(e.get("cuda_torch2_bytes", e["storage_bytes"]) for e in kept)
            acc["cuda"] += b
            acc["by_grad_fn_cuda"][kept[0]["grad_fn"]] = acc["by_grad_fn_cuda"].get(kept[0]["grad_fn"], 0) + b
        acc["per_storage"][e0["storage"]] = (e0["storage_bytes"], b)
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
    ap.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32",
                    help="fp32, bf16 (model cast to bf16) or bf16-amp (fp32 weights under CPU bf16 autocast)")
    ap.add_argument("--autocast", action="store_true",
                    help="run the forward under torch.autocast('cpu', bfloat16) also for --precision bf16")
    ap.add_argument("--optimizer", choices=["adamw", "sgd", "sgd-momentum", "adafactor", "adafactor-torch", "none"],
                    default="adamw")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--dropout-off", action="store_true", default=True,
                   help="set every dropout probability to 0 (the default)")
    g.add_argument("--keep-dropout", action="store_true", help="keep the config's dropout probabilities")
    ap.add_argument("--freeze", action="append", default=[], metavar="GLOB",
                    help="freeze the parameters whose names match this glob (repeatable)")
    ap.add_argument("--checkpointing", choices=["none", "full"], default="none",
                    help="gradient checkpointing of the decoder layers")
    ap.add_argument("--checkpoint-reentrant", choices=["true", "false"], default="true",
                    help="torch.utils.checkpoint's use_reentrant (default true)")
    ap.add_argument("--checkpoint-every", type=int, default=1, metavar="N",
                    help="checkpoint the layers whose index is a multiple of N")
    ap.add_argument("--lora", metavar="SPEC", default=None,
                    help="PEFT LoRA: r=16,alpha=32,dropout=0.05,targets=q_proj+v_proj (or targets=all-linear); every "
                         "field optional (r=8, alpha=8, dropout=0, targets: PEFT's per-model default); '' for all "
                         "defaults")
    ap.add_argument("--lora-dtype", choices=["fp32", "base"], default="fp32",
                    help="adapter dtype: fp32 (PEFT autocast_adapter_dtype=True, the default) or base")
    ap.add_argument("--input-require-grads", choices=["true", "false"], default=None,
                    help="transformers' enable_input_require_grads (forward hook on the input embeddings); default: "
                         "on for LoRA with checkpointing (PeftModel.__init__ on a gradient-checkpointed model)")
    ap.add_argument("--enable-input-require-grads", action="store_true", help="the same as --input-require-grads true")
    ap.add_argument("--no-tensors", action="store_true", help="omit the per-tensor list")
    ap.add_argument("--loss", choices=["ce", "chunked"], default="ce",
                    help="chunked: torchtune's chunked output head + CEWithChunkedOutputLoss (torchtune_loss.py)")
    ap.add_argument("--loss-chunks", type=int, default=8, metavar="N", help="torchtune's num_output_chunks")
    ap.add_argument("--logits-to-keep", type=int, default=0, metavar="N",
                    help="transformers' logits_to_keep: the head and the loss over the last N positions")
    ap.add_argument("--moe-routing", choices=["balanced", "worst"], default="balanced",
                    help="the experts MoE routers pick (trainmem's --moe-routing)")
    a = ap.parse_args(argv)
    with open(a.config) as f:
        cfg = json.load(f)
    for s in a.set:
        if "=" not in s:
            ap.error(f"--set expects key=value, got {s!r}")
        k, v = s.split("=", 1)
        cfg[k] = _parse_value(v)
    irg = None if a.input_require_grads is None else a.input_require_grads == "true"
    res = measure(cfg, a.batch, a.seq, a.precision, a.optimizer, dropout_off=not a.keep_dropout,
                  with_tensors=not a.no_tensors, freeze=a.freeze, checkpointing=a.checkpointing,
                  checkpoint_reentrant=a.checkpoint_reentrant == "true", checkpoint_every=a.checkpoint_every,
                  lora=a.lora, lora_dtype=a.lora_dtype,
                  enable_input_require_grads=True if a.enable_input_require_grads else irg,
                  autocast=a.autocast, loss=a.loss, loss_chunks=a.loss_chunks,
                  logits_to_keep=a.logits_to_keep, moe_routing=a.moe_routing)
    json.dump(res, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
