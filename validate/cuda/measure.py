#!/usr/bin/env python3
"""Measure real training steps on a CUDA GPU, the way trainmem simulates them, and write the measurement as
JSON (format trainmem-measurement-v1) for validate/measured/.

    python3 validate/cuda/measure.py --model gpt2 --batch 8 --seq 1024 --precision bf16-amp \
        --out validate/measured/h100_gpt2_b8_t1024_bf16amp.json

The model is built from trainmem's own preset (data/models/<name>.json, the real config.json values) or a
config.json path, with random weights and without downloading anything: transformers'
AutoModelForCausalLM.from_config for --impl hf, and nanoGPT's model.py (validate/nanogpt.py) for
--impl nanogpt. The training loop is the one trainmem's --loop names:

  nanogpt  nanoGPT train.py: `logits, loss = model(X, Y)`; `loss = loss / grad_accum`; the next batch is
           fetched right after the forward; GradScaler (enabled for float16); clip_grad_norm_(1.0);
           optimizer.step(); zero_grad(set_to_none=True). AdamW from configure_optimizers (fused on CUDA).
  hf       transformers Trainer: each micro-batch's tensors moved to the device, `loss = model(input_ids,
           labels=labels).loss` (the logits dropped), divided by grad_accum when > 1, backward (GradScaler for
           float16), clip_grad_norm_(1.0), step, zero_grad(set_to_none=True). torch.optim.AdamW with the
           decayed (dim >= 2) and the other parameters in two groups.

What is recorded, per step and micro-batch: torch.cuda.memory_allocated() and memory_reserved() at each point
of the loop, max_memory_allocated() and max_memory_reserved() over the run, the CUDA context (mem_get_info
before and after torch initialises the device), nvidia-smi's figure for this process at the end, the
allocator's trace (every alloc/free/segment action with its size, from torch.cuda.memory._record_memory_history)
and the environment. `figures` holds the values validate/compare.py checks against trainmem, and
`trainmem_args` the trainmem flags that describe the same run.

--device cpu runs the same loop on the CPU without memory figures (a smoke test of this script where there
is no GPU; only --impl nanogpt there, since transformers may be missing).
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # validate/: nanogpt.py

FORMAT = "trainmem-measurement-v1"
PRECISIONS = ("fp32", "fp16-amp", "bf16-amp", "fp16", "bf16")
AUTOCAST = {"fp16-amp": torch.float16, "bf16-amp": torch.bfloat16}
CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
# trace actions kept, as small integers
ACTIONS = {"alloc": 0, "free_completed": 1, "segment_alloc": 2, "segment_free": 3, "segment_map": 4,
           "segment_unmap": 5, "oom": 6}


def parse_value(text):
    """A --set value as trainmem reads it: JSON when it parses (numbers, true/false, null), else a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def load_config(model, sets):
    path = model if model.endswith(".json") else os.path.join(ROOT, "data", "models", model + ".json")
    with open(path) as f:
        cfg = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    for s in sets:
        key, _, value = s.partition("=")
        cfg[key] = parse_value(value)
    return cfg


def gpu_catalog_name(torch_name):
    """trainmem's catalog key (data/gpus/gpus.json) for torch.cuda.get_device_name(), or None."""
    with open(os.path.join(ROOT, "data", "gpus", "gpus.json")) as f:
        gpus = json.load(f)["gpus"]
    return next((g["name"] for g in gpus if g["torch_name"] == torch_name), None)


def build_model(cfg, impl, attention, use_cache=False):
    if impl == "nanogpt":
        import nanogpt
        conf = nanogpt.GPTConfig(block_size=cfg.get("block_size", 1024), vocab_size=cfg.get("vocab_size", 50304),
                                 n_layer=cfg.get("n_layer", 12), n_head=cfg.get("n_head", 12),
                                 n_embd=cfg.get("n_embd", 768), dropout=cfg.get("dropout", 0.0),
                                 bias=cfg.get("bias", True))
        return nanogpt.GPT(conf, flash=(attention == "sdpa"))
    import transformers
    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **kwargs)
    # training never uses the KV cache; generate() does (its DynamicCache)
    config.use_cache = use_cache
    # transformers 5.x takes `dtype`; 4.x named it `torch_dtype`
    major = int(transformers.__version__.split(".")[0])
    dtype_kw = "dtype" if major >= 5 else "torch_dtype"
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention,
                                                         **{dtype_kw: torch.float32})


def parse_lora(text):
    """trainmem's --lora syntax, r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj: a token without '=' continues
    the previous key's list (the targets)."""
    out, key = {}, None
    for tok in [t for t in text.split(",") if t]:
        if "=" in tok:
            key, _, value = tok.partition("=")
            out[key] = [value] if key == "targets" else value
        elif key == "targets":
            out[key].append(tok)
        else:
            raise SystemExit(f"--lora {text}: expected key=value items")
    return out


def apply_lora(model, text):
    """peft's get_peft_model with trainmem's --lora values; peft's defaults (r=8, lora_alpha=8, dropout 0, the
    model type's default target modules) where a key is missing. Adapters stay float32 (peft's
    autocast_adapter_dtype=True), as trainmem's --lora-dtype fp32."""
    import peft
    kv = parse_lora(text)
    kwargs = {"task_type": "CAUSAL_LM"}
    if "r" in kv:
        kwargs["r"] = int(kv["r"])
    if "alpha" in kv:
        kwargs["lora_alpha"] = float(kv["alpha"])
    if "dropout" in kv:
        kwargs["lora_dropout"] = float(kv["dropout"])
    if "targets" in kv:
        t = kv["targets"]
        kwargs["target_modules"] = "all-linear" if t == ["all-linear"] else t
    return peft.get_peft_model(model, peft.LoraConfig(**kwargs)), peft.__version__


def make_optimizer(model, args, device):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    impl = args.optimizer_impl
    if impl == "auto":
        # trainmem's resolve_optimizer_impl: nanoGPT's configure_optimizers asks for fused AdamW on CUDA;
        # torch.optim defaults to foreach on CUDA
        if device != "cuda":
            impl = "for-loop"
        elif args.loop == "nanogpt" and args.optimizer == "adamw":
            impl = "fused"
        else:
            impl = "foreach"
    if impl == "fused" and args.optimizer not in ("adamw", "adam"):
        raise SystemExit(f"--optimizer-impl fused: trainmem models fused kernels for Adam and AdamW only")
    extra = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[impl]
    if args.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=1e-4, **extra), impl
    if args.optimizer == "adam":
        return torch.optim.Adam(groups, lr=1e-4, **extra), impl
    if args.optimizer in ("sgd", "sgd-momentum"):
        momentum = 0.9 if args.optimizer == "sgd-momentum" else 0.0
        return torch.optim.SGD(groups, lr=1e-4, momentum=momentum, **extra), impl
    raise SystemExit(f"--optimizer {args.optimizer}: expected adamw, adam, sgd or sgd-momentum")


def init_fake_process_group(world, rank=0):
    """Rank 0 of a `world`-rank job on this one GPU: torch's fake process group (the "fake" backend that
    torch/testing/_internal/distributed/fake_pg.py registers, the one torchtitan's memory estimation uses) runs no
    collective and allocates nothing, while FSDP, DDP and accelerate do everything else as rank 0 of `world`. What
    it leaves out is what trainmem keeps outside the caching allocator anyway: NCCL's communicators and buffers."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # importing it registers "fake"
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29512"})
    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def make_accelerator(args):
    """accelerate's Accelerator as the Trainer builds it: mixed_precision "bf16" for bf16-amp ("no" otherwise),
    and for --sharding fsdp1/fsdp2 the FullyShardedDataParallelPlugin that transformers' _process_fsdp_args makes
    of `fsdp="full_shard auto_wrap"` (trainmem's src/core/fsdp.cc and fsdp1.cc cite it): the decoder layers
    wrapped (transformer_based_wrap over _no_split_modules), FULL_SHARD / reshard_after_forward, no CPU-RAM-
    efficient loading; FSDP1 with use_orig_params, sync_module_states, NO_PREFETCH, forward_prefetch off."""
    import accelerate
    from accelerate.utils import FullyShardedDataParallelPlugin
    mp = {"bf16-amp": "bf16", "fp16-amp": "fp16"}.get(args.precision, "no")
    kwargs = {"mixed_precision": mp}
    if args.sharding in ("fsdp1", "fsdp2"):
        common = {"fsdp_version": 2 if args.sharding == "fsdp2" else 1, "auto_wrap_policy": "transformer_based_wrap",
                  "cpu_ram_efficient_loading": False, "state_dict_type": "SHARDED_STATE_DICT",
                  "activation_checkpointing": False}
        if args.sharding == "fsdp2":
            common["reshard_after_forward"] = True
        else:
            common.update({"sharding_strategy": "FULL_SHARD", "use_orig_params": True, "sync_module_states": True,
                           "backward_prefetch": "NO_PREFETCH", "forward_prefetch": False, "limit_all_gathers": True})
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(**common)
    if args.dp_shard:
        from accelerate.parallelism_config import ParallelismConfig
        kwargs["parallelism_config"] = ParallelismConfig(dp_replicate_size=args.world // args.dp_shard,
                                                         dp_shard_size=args.dp_shard)
    return accelerate.Accelerator(**kwargs), accelerate.__version__


def load_tensor_parallel(cfg, attention):
    """transformers 5.x's own tensor parallelism, rank 0 of the fake world: the model is written once with random
    weights (save_pretrained, safetensors, in a temporary folder) and read back with from_pretrained(...,
    tp_plan="auto"), which loads this rank's shards onto the device (trainmem's --tp N). Returns the model and the
    rank's parameter count (local shards: a DTensor's to_local())."""
    import shutil
    import tempfile
    import transformers
    model = build_model(cfg, "hf", attention)
    folder = tempfile.mkdtemp(prefix="trainmem-tp-")
    try:
        model.save_pretrained(folder)
        del model
        major = int(transformers.__version__.split(".")[0])
        dtype_kw = "dtype" if major >= 5 else "torch_dtype"
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", attn_implementation=attention,
                                                                  **{dtype_kw: torch.float32})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    model.config.use_cache = False
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p
    return model, sum(local(p).numel() for p in model.parameters())


def ddp_inplace_hook(state, bucket):
    """DDP's default all-reduce hook (reducer.cpp's AllReduceCommHook: the bucket divided by the world size, then
    all-reduced in place) with the all-reduce left out, since the fake process group's futures carry no tensors
    for the Reducer to read: the same buffers, the same in-place writes."""
    buf = bucket.buffer()
    buf.div_(state)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


class Recorder:
    """memory_allocated / memory_reserved at named points of the loop."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.points = []

    def mark(self, point, step=0, micro=0):
        if not self.cuda:
            self.points.append({"point": point, "step": step, "micro_batch": micro})
            return
        torch.cuda.synchronize()
        self.points.append({"point": point, "step": step, "micro_batch": micro,
                            "allocated_bytes": torch.cuda.memory_allocated(),
                            "reserved_bytes": torch.cuda.memory_reserved(),
                            "max_allocated_bytes": torch.cuda.max_memory_allocated(),
                            "max_reserved_bytes": torch.cuda.max_memory_reserved()})

    def at(self, point, step):
        for p in self.points:
            if p["point"] == point and p["step"] == step:
                return p
        return None


def nvidia_smi():
    """(this process's used MiB or None, the GPU's used MiB or None, driver version or None)."""
    def query(args):
        try:
            return subprocess.run(["nvidia-smi"] + args, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    mine = None
    for line in query(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]).splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0] == str(os.getpid()) and parts[1].isdigit():
            mine = int(parts[1])
    gpu = query(["--query-gpu=memory.used,driver_version", "--format=csv,noheader,nounits"]).splitlines()
    used, driver = None, None
    if gpu:
        parts = [x.strip() for x in gpu[0].split(",")]
        if parts and parts[0].isdigit():
            used = int(parts[0])
        if len(parts) > 1:
            driver = parts[1]
    return mine, used, driver


def autocast_ctx(args):
    """torch.autocast for --precision *-amp, else a disabled one."""
    if args.precision in AUTOCAST:
        return torch.autocast(args.device, dtype=AUTOCAST[args.precision])
    return torch.autocast(args.device, enabled=False)


def place(model, device, cuda):
    """Counts the parameters, resets the peak statistics and moves the model: (parameter count, Recorder)."""
    params = sum(p.numel() for p in model.parameters())
    rec = Recorder(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model.to(device)
    rec.mark("after model.to(device)")
    return params, rec


def exact(b):
    return {"bytes": int(b), "uncertainty_bytes": 0}


def step_figures(rec, step):
    """The figures of a loop with a forward per step: before and after the last step's forward, and the peaks."""
    steady, after_fwd = rec.at("before forward", step), rec.at("after forward", step)
    return {
        "steady_state_allocated_bytes": exact(steady["allocated_bytes"]),
        "steady_state_reserved_bytes": exact(steady["reserved_bytes"]),
        "after_forward_allocated_bytes": exact(after_fwd["allocated_bytes"]),
        "after_forward_reserved_bytes": exact(after_fwd["reserved_bytes"]),
        "peak_allocated_bytes": exact(torch.cuda.max_memory_allocated()),
        "peak_reserved_bytes": exact(torch.cuda.max_memory_reserved()),
    }


def collect_trace(args, env, cuda):
    """After the run: nvidia-smi, the allocator's trace and segments; (trace, segments, smi, gpu catalog key)."""
    gpu_key = None
    trace, segments = None, None
    smi = (None, None, None)
    if cuda:
        torch.cuda.synchronize()
        smi = nvidia_smi()
        env["driver"] = smi[2]
        gpu_key = gpu_catalog_name(env["gpu"])
        try:
            snap = torch.cuda.memory._snapshot()
            raw = snap.get("device_traces", [[]])[0]
            events = []
            for e in raw:
                code = ACTIONS.get(e.get("action"))
                if code is not None:
                    # `size` of an alloc entry is the requested size (orig_size), not the block's
                    events.append([code, int(e.get("size", 0)), int(e.get("addr", 0)), int(e.get("stream", 0))])
            # the ring buffer keeps the last max_entries entries of every action: a full one lost the start
            trace = {"actions": {v: k for k, v in ACTIONS.items()}, "events": events,
                     "truncated": len(raw) >= args.trace_entries}
            segments = [[int(s["address"]), int(s["total_size"]), s.get("segment_type", "")]
                        for s in snap.get("segments", [])]
        except Exception as exc:  # the private API changes between versions: keep the figures anyway
            trace = {"error": repr(exc)}
        torch.cuda.memory._record_memory_history(enabled=None)

    return trace, segments, smi, gpu_key


def add_device_total(figures, smi, smi_before):
    """nvidia-smi's figure for this process (or the GPU's growth) as device_total_bytes; says where it came from."""
    if smi[0] is not None:
        # nvidia-smi reports whole MiB
        figures["device_total_bytes"] = {"bytes": smi[0] * 1048576, "uncertainty_bytes": 1048576}
        device_total_from = "nvidia-smi --query-compute-apps, this process"
    elif smi[1] is not None and smi_before is not None:
        # in a container the process list may not show our PID: the GPU's used memory grew by ours
        figures["device_total_bytes"] = {"bytes": (smi[1] - smi_before) * 1048576,
                                         "uncertainty_bytes": 2 * 1048576}
        device_total_from = "nvidia-smi --query-gpu=memory.used, after minus before (PID not listed)"
    else:
        device_total_from = "not measured: nvidia-smi gave neither this process nor the GPU's usage"
    return device_total_from


def trainmem_flags(args, impl, gpu_key, run_flags):
    """The trainmem flags describing the run: the model, `run_flags` (the loop's), the torch version, the options."""
    flags = ["--model", args.model]
    for s in args.set:
        flags += ["--set", s]
    flags += ["--impl", impl, "--attention", args.attention] + run_flags
    flags += ["--torch", ".".join(torch.__version__.split("+")[0].split(".")[:2])]
    if args.alloc_conf:
        flags += ["--alloc-conf", args.alloc_conf]
    if args.checkpointing != "none":
        flags += ["--checkpointing", args.checkpointing]
    if args.lora:
        flags += ["--lora", args.lora]
    if args.moe_experts:
        flags += ["--moe-experts", args.moe_experts]
    if args.sharding != "none":
        flags += ["--sharding", args.sharding, "--dp", str(args.world)]
    if args.sharding == "ddp":
        # DistributedDataParallel(model)'s default; trainmem's DDP default is the Trainer's (not model.is_gradient_
        # checkpointing)
        flags += ["--find-unused-parameters", "false"]
    if args.dp_shard:
        flags += ["--dp-shard", str(args.dp_shard)]
    if args.tp > 1:
        flags += ["--tp", str(args.tp)]
    if gpu_key:
        flags += ["--gpu", gpu_key]
    return flags


def package(args, env, trainmem_args, figures, context, smi, smi_before, device_total_from, rec, segments, trace):
    """The measurement file's object (format trainmem-measurement-v1)."""
    cuda = args.device == "cuda"
    return {
        "format": FORMAT,
        "name": args.name or os.path.splitext(os.path.basename(args.out or "measurement"))[0],
        "source": "validate/cuda/measure.py, %s, %s" % (env.get("gpu", args.device),
                                                       datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")),
        "trainmem_args": trainmem_args,
        "env": env,
        "figures": figures,
        "context_bytes": context,
        "nvidia_smi": {"process_used_mib": smi[0], "gpu_used_mib": smi[1], "gpu_used_mib_before": smi_before,
                       "device_total_from": device_total_from if cuda else None},
        "points": rec.points,
        "segments": segments,
        "trace": trace,
    }


def run_inference(args, cfg, impl, model, env, context, smi_before, cuda):
    """trainmem's --task inference loops (src/sim/loop.cc Loop::inference and Loop::generate), on the device.

    Without --generate: `with torch.inference_mode(): outputs = model(input_ids)` in model.eval(), once per step;
    `outputs` stays bound until the next call returns. The figures are read as for training: before the last
    step's forward (the previous step's logits still bound), after it, and the peaks.

    With --generate N: `model.generate(input_ids, max_new_tokens=N)`, greedy (do_sample=False), transformers'
    default DynamicCache and generation config (pad_token_id = eos when the config has none), once, inside one
    autocast region under --precision *-amp. A forward pre-hook on the model reads the allocator when the second
    forward (the first decode step) starts: max_memory_allocated() then is the prefill's peak (and its token's
    ops), memory_allocated() is what trainmem calls "after prefill" plus what the second step made before its
    forward (prepare_inputs_for_generation's model_inputs); the peak statistics are then reset, so max_memory_allocated() at the end is the decode steps' peak."""
    if impl != "hf":
        raise SystemExit("--task inference: only with --impl hf")
    if args.lora or args.checkpointing != "none" or args.grad_accum != 1 or args.sharding != "none" or args.accelerate:
        raise SystemExit("--task inference: no --lora, --checkpointing, --grad-accum, --sharding or --accelerate")
    device = torch.device(args.device)
    if args.precision in CAST:
        model = model.to(CAST[args.precision])
    model.eval()
    params, rec = place(model, device, cuda)
    vocab = cfg.get("vocab_size", 50304)
    ids_cpu = torch.randint(0, vocab, (args.batch, args.seq), dtype=torch.long)
    autocast = lambda: autocast_ctx(args)

    figures = {"parameters": {"count": params}}
    if args.generate == 0:
        outputs = None
        for step in range(1, args.steps + 1):
            rec.mark("before forward", step, 1)
            X = ids_cpu.to(device)
            with torch.inference_mode(), autocast():
                outputs = model(input_ids=X)
            rec.mark("after forward", step, 1)
        del outputs
        if cuda:
            figures.update(step_figures(rec, args.steps))
    else:
        calls = {"n": 0, "prefill": None}

        def pre_hook(module, inputs):
            calls["n"] += 1
            if calls["n"] == 2 and cuda:
                torch.cuda.synchronize()
                calls["prefill"] = {"allocated_bytes": torch.cuda.memory_allocated(),
                                    "reserved_bytes": torch.cuda.memory_reserved(),
                                    "max_allocated_bytes": torch.cuda.max_memory_allocated(),
                                    "max_reserved_bytes": torch.cuda.max_memory_reserved()}
                rec.points.append(dict(calls["prefill"], point="second forward starts", step=2, micro_batch=1))
                torch.cuda.reset_peak_memory_stats()

        hook = model.register_forward_pre_hook(pre_hook)
        rec.mark("before generate", 1, 1)  # the model alone, as trainmem's "before generate"
        X = ids_cpu.to(device)
        with autocast():
            out_ids = model.generate(X, max_new_tokens=args.generate, do_sample=False)
        rec.mark("after generate", args.generate, 1)
        hook.remove()
        env["generated_tokens"] = int(out_ids.shape[1] - args.seq)
        env["forwards"] = calls["n"]
        if env["generated_tokens"] != args.generate:
            raise SystemExit(f"generate() stopped after {env['generated_tokens']} of {args.generate} tokens (every "
                             "sequence reached the eos): not the run trainmem simulates")
        del out_ids
        if cuda:
            before, pre = rec.at("before generate", 1), calls["prefill"]
            decode_peak = torch.cuda.max_memory_allocated()
            figures.update({
                "steady_state_allocated_bytes": exact(before["allocated_bytes"]),
                "after_forward_allocated_bytes": exact(pre["allocated_bytes"]),
                "prefill_peak_allocated_bytes": exact(pre["max_allocated_bytes"]),
                "decode_peak_allocated_bytes": exact(decode_peak),
                "peak_allocated_bytes": exact(max(pre["max_allocated_bytes"], decode_peak)),
                # reserved memory never shrinks without empty_cache: the end's is the peak
                "peak_reserved_bytes": exact(torch.cuda.memory_reserved()),
            })
    trace, segments, smi, gpu_key = collect_trace(args, env, cuda)
    trainmem_args = trainmem_flags(args, impl, gpu_key, [
        "--task", "inference", "--batch", str(args.batch), "--seq", str(args.seq), "--precision", args.precision]
        + (["--generate", str(args.generate)] if args.generate else ["--steps", str(args.steps)]))
    device_total_from = add_device_total(figures, smi, smi_before) if cuda else None
    return package(args, env, trainmem_args, figures, context, smi, smi_before, device_total_from, rec, segments,
                   trace)


# --- Pipeline parallelism (trainmem's --pp N --rank r): one rank of a torch.distributed.pipelining pipeline -----

def pp_stage_split(stages, layers, input_weight=1, output_weight=1):
    """torchtitan's generate_llm_fqn_per_model_part (v0.2.0) as trainmem's src/core/pp.cc pp_stage_split transcribes
    it: [(first layer, end layer, has the embeddings, has the norm and head)] per stage."""
    if stages == 1:
        return [(0, layers, True, True)]
    effective = layers + input_weight + output_weight
    per, extra = effective // stages, effective % stages
    if stages > effective or input_weight > per or output_weight > per:
        raise SystemExit(f"--pp {stages}: too few layers for torchtitan's split")
    out, current = [], 0
    for i in range(stages):
        n = per + (1 if i < extra else 0)
        if i == 0:
            n -= input_weight
        elif i == stages - 1:
            n -= output_weight
        begin = current
        current = min(layers, current + n)
        out.append((begin, current, i == 0, i == stages - 1))
    return out


class PpStageModule(torch.nn.Module):
    """One stage of transformers' LlamaForCausalLM, the ops trainmem's program runs for it (src/sim/forward_programs/
    llama.cc llama_model / llama_forward under Ctx::pp): LlamaModel.forward itself over the stage's layers, from the
    ids (first stage: embed_tokens) or from the received hidden states (inputs_embeds=x), then on the last stage the
    final norm and lm_head. The modules the stage does not hold are removed, as torchtitan's pipeline_module_split
    does (embed_tokens None, norm Identity where it is another stage's, lm_head absent); every stage keeps the
    rotary embedding (its inv_freq buffer), which LlamaModel.forward runs on each stage's input."""

    def __init__(self, causal_lm, begin, end, first, last):
        super().__init__()
        model = causal_lm.model
        model.layers = torch.nn.ModuleList(list(model.layers)[begin:end])
        if not first:
            model.embed_tokens = None
        if not last:
            model.norm = torch.nn.Identity()
        self.model = model
        self.lm_head = causal_lm.lm_head if last else None
        self.first, self.last = first, last

    def forward(self, x):
        if self.first:
            out = self.model(input_ids=x, use_cache=False)
        else:
            out = self.model(inputs_embeds=x, use_cache=False)
        hidden = out.last_hidden_state
        if not self.last:
            return hidden
        # LlamaForCausalLM.forward: logits = self.lm_head(hidden_states[:, slice(0, None), :]) (logits_to_keep 0)
        return self.lm_head(hidden[:, slice(0, None), :])


def pp_fake_p2p(env):
    """The fake process group (torch/testing/_internal/distributed/fake_pg.py; FakeProcessGroup in c10d) completes
    send/recv without moving data. Checked here on CPU tensors, before any CUDA allocation: batch_isend_irecv of an
    isend and an irecv. If it raises, the stage's P2P is replaced by no-ops (documented in env)."""
    import torch.distributed as dist
    try:
        a, b = torch.zeros(4), torch.zeros(4)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, (dist.get_rank() + 1) % dist.get_world_size()),
                                        dist.P2POp(dist.irecv, b, (dist.get_rank() + 1) % dist.get_world_size())])
        for w in works:
            w.wait()
        env["pp_p2p"] = "FakeProcessGroup's send/recv (batch_isend_irecv): no data moved, nothing allocated"
    except Exception as exc:  # noqa: BLE001 - any refusal: fall back to no-op P2P
        dist.batch_isend_irecv = lambda ops: []
        env["pp_p2p"] = f"FakeProcessGroup refused batch_isend_irecv ({exc!r}): dist.batch_isend_irecv patched to []"


def run_pipeline(args, cfg, impl, env, context, smi_before, cuda):
    """Rank r of an N-stage torch.distributed.pipelining pipeline (trainmem's --pp N --rank r --pp-schedule S
    --micro-batches M), as torchtitan v0.2.0's train step runs it, over torch's fake process group (rank r of N).

    The stage: the model built on the CPU with random weights and cast to the --precision dtype (pure bf16: torchtitan
    applies no autocast under PP), cut to rank r's stage by torchtitan's split (pp_stage_split) and moved to the
    device. PipelineStage(stage, r, N, device) with no input_args: the runtime shape inference of the first step
    (a no_grad forward on zeros). Its recv_object_list from the previous stage is answered here with the meta tensor
    the previous stage would send, (B, T, C) in the parameters' dtype, since a fake group's recv fills nothing.
    The schedule (ScheduleGPipe or Schedule1F1B) with n_microbatches M, the loss trainmem's program computes
    (transformers' ForCausalLMLoss, the model's own loss) and scale_grads=False (torchtitan's). Each step:
    `schedule.step(ids, target=None, losses=None)` on the first stage, `schedule.step(target=labels, losses=losses)`
    on the last, `schedule.step()` between (the batch of B x M rows on the device where it is used: the ids on the
    first stage, the labels on the last); then torchtitan's loss (`torch.mean(torch.stack(losses))` on the last
    stage, `torch.tensor([-1.0])` elsewhere), its clip_grad_norm_ (dist_utils: get_total_norm with foreach, ** 2,
    all_reduce over the pp group, ** 0.5, clip_grads_with_norm_), optimizer.step() (fused AdamW, one group) and
    zero_grad() (set_to_none). "after forward" is read when the schedule has run its most forwards without their
    backwards in the last step: the M-th forward (GPipe) or the min(M, N - r)-th (1F1B: its warmup), after the loss
    on the last stage."""
    import torch.distributed as dist
    from torch.distributed import pipelining
    if impl != "hf" or cfg.get("model_type") != "llama" or not cuda:
        raise SystemExit("--pp N: transformers' Llama causal LMs, on a GPU")
    if args.precision not in CAST:
        raise SystemExit("--pp N: pure bf16 or fp16 (torchtitan applies no autocast under PP)")
    if args.sharding != "none" or args.tp > 1 or args.lora or args.checkpointing != "none" or args.grad_accum != 1:
        raise SystemExit("--pp N: no --sharding, --tp, --lora, --checkpointing or --grad-accum")
    N, r, M = args.pp, args.pp_rank, args.micro_batches
    if not 0 <= r < N:
        raise SystemExit(f"--pp-rank {r}: expected 0..{N - 1}")
    init_fake_process_group(N, r)
    env["process_group"] = f"fake (rank {r} of {N}): send/recv move no data, NCCL is absent"
    pp_fake_p2p(env)
    import transformers
    env["transformers"] = transformers.__version__
    device = torch.device("cuda")
    dtype = CAST[args.precision]
    torch.manual_seed(0)
    model = build_model(cfg, impl, args.attention).to(dtype)
    begin, end, first, last = pp_stage_split(N, cfg["num_hidden_layers"])[r]
    stage_mod = PpStageModule(model, begin, end, first, last)
    del model
    env["pp_stage"] = {"stage": r, "layers": [begin, end], "embeddings": first, "norm_and_head": last}
    stage_mod.train()
    params, rec = place(stage_mod, device, cuda)

    # the shape inference's recv_object_list from the previous stage: what its send_object_list sends,
    # tuple(tree_map_only(torch.Tensor, lambda x: x.to("meta"), outputs)), here made directly
    hidden_meta = torch.empty((args.batch, args.seq, cfg["hidden_size"]), dtype=dtype, device="meta")

    def recv_object_list(object_list, *args, **kwargs):
        object_list[0] = (hidden_meta,)
        return None
    dist.recv_object_list = recv_object_list

    stage = pipelining.PipelineStage(stage_mod, r, N, device)
    vocab = cfg["vocab_size"]
    from transformers.loss.loss_utils import ForCausalLMLoss

    warm = M if args.pp_schedule == "gpipe" else min(M, N - r)
    state = {"step": 0, "forwards": 0}

    def after_forward():
        if not torch.is_grad_enabled():
            return  # the first step's shape inference (a no_grad forward), not one of the schedule's
        state["forwards"] += 1
        if state["step"] == args.steps and state["forwards"] == warm:
            rec.mark("after forward", state["step"], warm)

    def loss_fn(logits, labels):
        loss = ForCausalLMLoss(logits, labels, vocab)
        after_forward()
        return loss

    if not last:
        stage_mod.register_forward_hook(lambda mod, inp, out: after_forward())
    sched_cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[args.pp_schedule]
    schedule = sched_cls(stage, n_microbatches=M, loss_fn=loss_fn, scale_grads=False)
    optimizer = torch.optim.AdamW(stage_mod.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                  fused=True)
    ids_cpu = torch.randint(0, vocab, (args.batch * M, args.seq), dtype=torch.long)
    labels_cpu = torch.randint(0, vocab, (args.batch * M, args.seq), dtype=torch.long)
    group = dist.distributed_c10d._get_default_group()

    for step in range(1, args.steps + 1):
        state["step"], state["forwards"] = step, 0
        rec.mark("before forward", step, 1)
        X = ids_cpu.to(device) if first else None
        Y = labels_cpu.to(device) if last else None
        losses = [] if last else None
        if first:
            schedule.step(X, target=Y, losses=losses)
        else:
            schedule.step(target=Y, losses=losses)
        rec.mark("after step()", step, M)
        loss = torch.mean(torch.stack(losses)).to(device) if last else torch.tensor([-1.0], device=device)
        # torchtitan dist_utils.clip_grad_norm_ (foreach=True, pp_mesh): the total norm over this rank's gradients,
        # ** norm_type, all_reduce(SUM) over the pp group, ** (1 / norm_type), then clip_grads_with_norm_
        grads = [p.grad for p in stage_mod.parameters() if p.grad is not None]
        total_norm = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
        total_norm **= 2.0
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=group)
        total_norm **= 1.0 / 2.0
        torch.nn.utils.clip_grads_with_norm_(stage_mod.parameters(), 1.0, total_norm, True)
        del grads
        rec.mark("after clip_grad_norm_", step)
        optimizer.step()
        rec.mark("after optimizer step", step)
        optimizer.zero_grad(set_to_none=True)
        del loss, total_norm, losses, X, Y
        rec.mark("after zero_grad", step)

    trace, segments, smi, gpu_key = collect_trace(args, env, cuda)
    trainmem_args = trainmem_flags(args, impl, gpu_key, [
        "--batch", str(args.batch), "--seq", str(args.seq), "--precision", args.precision, "--optimizer", "adamw",
        "--optimizer-impl", "fused", "--steps", str(args.steps), "--pp", str(N), "--rank", str(r),
        "--pp-schedule", args.pp_schedule, "--micro-batches", str(M)])
    figures = {"parameters": {"count": params}}
    figures.update(step_figures(rec, args.steps))
    device_total_from = "not compared: a fake process group (no NCCL communicators)"
    return package(args, env, trainmem_args, figures, context, smi, smi_before, device_total_from, rec, segments,
                   trace)


def run(args):
    cuda = args.device == "cuda"
    if args.alloc_conf:
        # read when the caching allocator initialises, at the first CUDA call below
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --device cpu for a smoke test")
    cfg = load_config(args.model, args.set)
    impl = args.impl or ("nanogpt" if cfg.get("model_type") == "nanogpt" else "hf")
    if args.loop is None:
        args.loop = "nanogpt" if impl == "nanogpt" else "hf"
    device = torch.device(args.device)
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": args.device}
    context = None
    smi_before = nvidia_smi()[1] if cuda else None  # the GPU's used MiB before this process touches it
    if cuda:
        free0, total = torch.cuda.mem_get_info()  # initialises the CUDA context
        env.update({"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
                    "cudnn": torch.backends.cudnn.version(), "sm": "%d%d" % torch.cuda.get_device_capability(),
                    "runtime_total_bytes": total})
        context = total - free0
        try:
            torch.cuda.memory._record_memory_history(max_entries=args.trace_entries, stacks="python",
                                                     context=None)
        except TypeError:
            torch.cuda.memory._record_memory_history(max_entries=args.trace_entries)
    if args.pp > 1:
        return run_pipeline(args, cfg, impl, env, context, smi_before, cuda)
    if args.tp > 1:
        if not cuda or args.sharding != "none" or args.world not in (1, args.tp):
            raise SystemExit("--tp N: rank 0 of N on a GPU, without --sharding (the world is the TP group)")
        args.world = args.tp
    if args.world > 1:
        if not cuda or (args.sharding == "none" and args.tp <= 1):
            raise SystemExit("--world N: rank 0 of N on a GPU, with --sharding ddp, fsdp1 or fsdp2")
        init_fake_process_group(args.world)
        env["process_group"] = f"fake (rank 0 of {args.world}): collectives run no communication, NCCL is absent"
    if impl == "hf":
        import transformers
        env["transformers"] = transformers.__version__

    torch.manual_seed(0)
    generating = args.task == "inference" and args.generate > 0
    tp_params = None
    if args.tp > 1:
        if impl != "hf" or args.task != "train" or args.lora or args.checkpointing != "none" or args.precision in CAST:
            raise SystemExit("--tp N: training an --impl hf model in fp32 or under autocast, no LoRA or checkpointing")
        model, tp_params = load_tensor_parallel(cfg, args.attention)
    else:
        model = build_model(cfg, impl, args.attention, use_cache=generating)
    env["experts_implementation"] = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if args.moe_experts and env["experts_implementation"] != args.moe_experts:
        raise SystemExit(f"--moe-experts {args.moe_experts}: the model took {env['experts_implementation']!r}")
    if args.task == "inference":
        return run_inference(args, cfg, impl, model, env, context, smi_before, cuda)
    if args.precision in CAST:
        # on the CPU, then to the device: trainmem loads the model as such. Before LoRA, as from_pretrained(
        # dtype=...) then get_peft_model: peft's autocast_adapter_dtype keeps the adapters float32
        model = model.to(CAST[args.precision])
    if args.checkpointing == "full":
        # transformers' gradient_checkpointing_enable(): every decoder layer under torch.utils.checkpoint, with
        # the library's default use_reentrant (trainmem's --checkpointing full models the same default)
        if impl != "hf":
            raise SystemExit("--checkpointing full: only with --impl hf (transformers' gradient_checkpointing_enable)")
        model.gradient_checkpointing_enable()
    if args.lora:
        if impl != "hf":
            raise SystemExit("--lora: only with --impl hf (peft)")
        model, env["peft"] = apply_lora(model, args.lora)
        env["lora_adapter_dtype"] = str(next(p.dtype for n, p in model.named_parameters() if "lora_A" in n))
    model.train()
    if args.sharding in ("fsdp1", "fsdp2") or args.accelerate:
        if not cuda:
            raise SystemExit("--sharding fsdp1/fsdp2 and --accelerate run on a GPU")
        acc, env["accelerate"] = make_accelerator(args)
        if args.sharding in ("fsdp1", "fsdp2"):
            # transformers' Trainer._prepare_for_training under FSDP, the model as loaded on the CPU (fully_shard /
            # FSDP move each unit to the device as they shard it). FSDP1 (delay_optimizer_creation):
            # accelerator.prepare(model), the optimizer over the sharded parameters, then prepare(model, optimizer).
            # FSDP2 ("Can't delay optimizer creation when using FSDP2"): the optimizer first, then
            # prepare(model, optimizer), whose _prepare_fsdp2 swaps the optimizer's parameters for the shards.
            params = sum(p.numel() for p in model.parameters())
            rec = Recorder(cuda)
            torch.cuda.reset_peak_memory_stats()
            if args.sharding == "fsdp1":
                model = acc.prepare(model)
                rec.mark("after accelerator.prepare(model)")
            optimizer, opt_impl = make_optimizer(model, args, args.device)
            model, optimizer = acc.prepare(model, optimizer)
            rec.mark("after accelerator.prepare(model, optimizer)")
        else:
            # the Trainer on one GPU: the model moved to the device in __init__ (_move_model_to_device), the
            # optimizer made, then accelerator.prepare(model, optimizer), which wraps forward in autocast and
            # convert_outputs_to_fp32 under mixed precision
            params, rec = place(model, device, cuda)
            optimizer, opt_impl = make_optimizer(model, args, args.device)
            model, optimizer = acc.prepare(model, optimizer)
    else:
        acc = None
        params, rec = place(model, device, cuda)
        if tp_params is not None:
            params = tp_params  # the rank's shards (from_pretrained put them on the device already)
        if args.sharding == "ddp":
            # trainmem's DDP: DistributedDataParallel(model) with its defaults (bucket_cap_mb 25, no
            # gradient_as_bucket_view, find_unused_parameters False)
            model = torch.nn.parallel.DistributedDataParallel(model)
            model.register_comm_hook(state=args.world, hook=ddp_inplace_hook)
            rec.mark("after DistributedDataParallel(model)")
        optimizer, opt_impl = make_optimizer(model, args, args.device)
    use_scaler = args.precision == "fp16-amp"
    scaler = torch.amp.GradScaler("cuda", enabled=use_scaler) if cuda else None
    vocab = cfg.get("vocab_size", 50304)
    ids_cpu = torch.randint(0, vocab, (args.batch, args.seq), dtype=torch.long)
    labels_cpu = torch.randint(0, vocab, (args.batch, args.seq), dtype=torch.long)

    # under accelerate the prepared forward runs in autocast itself (the Trainer's compute_loss_context_manager adds
    # none on a GPU)
    autocast = (lambda: contextlib.nullcontext()) if acc is not None else (lambda: autocast_ctx(args))

    def backward(loss):
        if acc is not None:
            acc.backward(loss)
            return
        (scaler.scale(loss) if scaler is not None and use_scaler else loss).backward()

    def sync_context(micro):
        """The Trainer's accumulation: every micro-batch but the last under no_sync (accelerate's, or DDP's)."""
        if micro == A:
            return contextlib.nullcontext()
        if acc is not None and args.world > 1:
            return acc.no_sync(model)
        if args.sharding == "ddp":
            return model.no_sync()
        return contextlib.nullcontext()

    def get_batch():
        return ids_cpu.to(device), labels_cpu.to(device)  # x first, then y

    A = args.grad_accum
    X = Y = None
    if args.loop == "nanogpt":
        X, Y = get_batch()
    for step in range(1, args.steps + 1):
        rec.mark("before forward", step, 1)
        for micro in range(1, A + 1):
            if args.loop == "nanogpt":
                with autocast():
                    logits, loss = model(X, Y)
                    loss = loss / A
                X, Y = get_batch()
                if micro == A:
                    rec.mark("after forward", step, micro)
                backward(loss)
            else:
                X, Y = get_batch()
                with sync_context(micro):
                    with autocast():
                        loss = model(input_ids=X, labels=Y).loss
                    if A > 1:
                        loss = loss / A
                    if micro == A:
                        rec.mark("after forward", step, micro)
                    backward(loss)
            if args.loop == "hf":
                # Trainer.training_step returns loss.detach(): the graph, and any leaf it holds (peft's
                # enable_input_require_grads makes the embedding output one, with a .grad), dies here. nanoGPT's
                # train.py keeps `loss` to the next iteration.
                del loss
            rec.mark("after backward", step, micro)
        if scaler is not None and use_scaler:
            scaler.unscale_(optimizer)
        if acc is not None:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        elif tp_params is not None:
            # transformers' TP leaves the replicated parameters plain tensors beside the DTensor shards, and
            # _foreach_norm refuses the mix: one clip per kind (two foreach norms of a few 0-dim tensors)
            dt = [p for p in model.parameters() if hasattr(p, "to_local")]
            torch.nn.utils.clip_grad_norm_(dt, 1.0)
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if not hasattr(p, "to_local")], 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        rec.mark("after clip_grad_norm_", step)
        if scaler is not None and use_scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        rec.mark("after optimizer step", step)
        optimizer.zero_grad(set_to_none=True)
        rec.mark("after zero_grad", step)

    trace, segments, smi, gpu_key = collect_trace(args, env, cuda)
    trainmem_args = trainmem_flags(args, impl, gpu_key, [
        "--batch", str(args.batch), "--seq", str(args.seq), "--precision", args.precision, "--optimizer", args.optimizer,
        "--optimizer-impl", opt_impl, "--grad-accum", str(A), "--loop", args.loop, "--steps", str(args.steps)])

    figures = {"parameters": {"count": params}}
    device_total_from = None
    if cuda:
        figures.update(step_figures(rec, args.steps))
        if args.world > 1:
            # trainmem's device total adds the NCCL communicators' buffers, which the fake process group never makes
            device_total_from = "not compared: a fake process group (no NCCL communicators)"
        else:
            device_total_from = add_device_total(figures, smi, smi_before)
    return package(args, env, trainmem_args, figures, context, smi, smi_before, device_total_from, rec, segments,
                   trace)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="trainmem preset name or config.json path")
    ap.add_argument("--set", action="append", default=[], help="override a config key: key=value")
    ap.add_argument("--impl", choices=("hf", "nanogpt"))
    ap.add_argument("--attention", choices=("eager", "sdpa"), default="sdpa")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--precision", choices=PRECISIONS, default="bf16-amp")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--optimizer-impl", choices=("auto", "foreach", "fused", "for-loop"), default="auto")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--loop", choices=("nanogpt", "hf"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--checkpointing", choices=("none", "full"), default="none")
    ap.add_argument("--lora", help="peft LoRA as trainmem's --lora: r=16,alpha=32,targets=q_proj,v_proj")
    ap.add_argument("--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF for the run, e.g. expandable_segments:True")
    ap.add_argument("--task", choices=("train", "inference"), default="train")
    ap.add_argument("--generate", type=int, default=0, help="with --task inference: model.generate(max_new_tokens=N)")
    ap.add_argument("--moe-experts", choices=("grouped_mm",),
                    help="a mixture-of-experts model's experts_implementation, as trainmem's --moe-experts: "
                         "grouped_mm is transformers 5.x's default; the run checks the model took it")
    ap.add_argument("--sharding", choices=("none", "ddp", "fsdp1", "fsdp2"), default="none",
                    help="as trainmem's --sharding, for rank 0 of --world ranks over a fake process group")
    ap.add_argument("--world", type=int, default=1, help="data-parallel ranks (trainmem's --dp); rank 0 runs")
    ap.add_argument("--dp-shard", type=int, default=0, help="with --sharding fsdp2: HSDP's shard group size "
                    "(accelerate's ParallelismConfig(dp_replicate_size=world / K, dp_shard_size=K))")
    ap.add_argument("--tp", type=int, default=1, help="transformers' tensor parallelism (from_pretrained "
                    "tp_plan='auto'), rank 0 of N over a fake process group (trainmem's --tp N)")
    ap.add_argument("--pp", type=int, default=1, help="torch.distributed.pipelining stages (trainmem's --pp N): "
                    "rank --pp-rank of N over a fake process group, as torchtitan v0.2.0's train step runs it")
    ap.add_argument("--pp-rank", type=int, default=0, help="with --pp: the rank measured (trainmem's --rank)")
    ap.add_argument("--pp-schedule", choices=("gpipe", "1f1b"), default="1f1b")
    ap.add_argument("--micro-batches", type=int, default=4, help="with --pp: micro-batches of --batch rows each")
    ap.add_argument("--accelerate", action="store_true",
                    help="one GPU through accelerate's prepare(model, optimizer), as the Trainer runs it (forward "
                         "under accelerate's autocast and convert_outputs_to_fp32)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--trace-entries", type=int, default=200000)
    ap.add_argument("--name")
    ap.add_argument("--out", help="write the JSON here (default: stdout)")
    args = ap.parse_args(argv)
    out = run(args)
    trace = out.pop("trace")
    text = json.dumps(out, indent=1)[:-2] + ',\n "trace": ' + json.dumps(trace, separators=(",", ":")) + "\n}\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
