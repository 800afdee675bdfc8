"""One rank of FSDP2 over a PEFT LoRA model, as accelerate's fsdp2_prepare_model builds it, on one GPU with a fake
process group (world size 4, rank 0: collectives are no-ops, allocations are real). Prints each unit's parameters,
each all-gather's output dtype and numel, each reduce-scatter's gradients, and memory_allocated() after prepare:
the figures tests/unit/fsdp_lora_test.cc pins (read on 2026-11-27 with torch 2.11.0+cu130, accelerate 1.15.0,
peft 0.21.0, transformers 5.17.0 on one H200).

    RANK=0 WORLD_SIZE=4 LOCAL_RANK=0 python3 validate/cuda/fsdp2_lora_probe.py bf16   # mixed_precision "bf16", fp32 model
    RANK=0 WORLD_SIZE=4 LOCAL_RANK=0 python3 validate/cuda/fsdp2_lora_probe.py no     # a bf16 model, fp32 adapters
    (append "nowrap" to leave accelerate's default NO_WRAP policy: only the root, the embedding and lm_head)
"""
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
torch.cuda.set_device(0)

import accelerate  # noqa: E402
import peft  # noqa: E402
import torch.distributed.fsdp._fully_shard._fsdp_param_group as G  # noqa: E402
import transformers as T  # noqa: E402
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.utils.fsdp_utils import _find_final_norm  # noqa: E402

print(torch.__version__, accelerate.__version__, peft.__version__, T.__version__)
all_gather, reduce = G.foreach_all_gather, G.foreach_reduce


def traced_all_gather(params, *a, **k):
    r = all_gather(params, *a, **k)
    print("all-gather", len(params), r.all_gather_output.dtype, r.all_gather_output.numel())
    return r


def traced_reduce(params, grads, *a, **k):
    # a[3], a[4]: foreach_reduce's orig_dtype and reduce_dtype
    print("reduce-scatter", len(params), grads[0].dtype, sum(g.numel() for g in grads), a[3], a[4])
    return reduce(params, grads, *a, **k)


G.foreach_all_gather, G.foreach_reduce = traced_all_gather, traced_reduce
precision = sys.argv[1]
config = T.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000)
model = T.LlamaForCausalLM(config).to(torch.float32 if precision == "bf16" else torch.bfloat16)
model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
print("accelerate _find_final_norm(PeftModel):", _find_final_norm(model))
plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if "nowrap" in sys.argv else \
    FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
acc = accelerate.Accelerator(mixed_precision=precision, fsdp_plugin=plugin)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
model, opt = acc.prepare(model, opt)
for name, module in model.named_modules():
    state = getattr(module, "_get_fsdp_state", None)
    group = state and state()._fsdp_param_group
    if group:
        print("unit", name or "<root>", len(group.fsdp_params), "parameters,",
              sum(f.sharded_param.requires_grad for f in group.fsdp_params), "trainable,",
              sorted({str(f.sharded_param.dtype) for f in group.fsdp_params}))
print("memory_allocated after prepare", torch.cuda.memory_allocated())
x = torch.randint(0, 1000, (1, 64), device="cuda")
for step in range(2):
    with acc.autocast():
        loss = model(input_ids=x, labels=x).loss
    acc.backward(loss)
    if step == 0:
        print("parameters with a .grad:", sum(p.grad is not None for p in model.parameters()))
    opt.step()
    opt.zero_grad()
    print("step", step, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated())
