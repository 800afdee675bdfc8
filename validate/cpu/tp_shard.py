"""Rank 0 of transformers 5.x tensor parallelism (tp_plan="auto") on a reference Llama-shaped model (models.py).

`apply_tp(model, tp)` does to a models.LlamaForCausalLM what transformers does when it loads the model over `tp`
ranks, for rank 0, from src/transformers/integrations/tensor_parallel.py (5.x):

* the plan: LlamaConfig.base_model_tp_plan (configuration_llama.py @008e574; mistral and qwen2 have the same)
  q_proj/k_proj/v_proj/gate_proj/up_proj "colwise", o_proj/down_proj "rowwise", and LlamaForCausalLM._tp_plan
  lm_head "colwise_gather_output"; embed_tokens and the norms have no entry (replicated);
* the shards (shard_and_distribute_module -> get_tensor_shard, rank 0: [0, ceil(n / tp))): ColwiseParallel
  weight dim -2 and bias dim -1; RowwiseParallel weight dim -1, bias whole;
* the hooks (distribute_module: a forward pre-hook and a forward hook per planned module):
  ColwiseParallel._prepare_input_fn -> all_reduce_backward(input); _prepare_output_fn -> all_gather(outputs) when
  gather_output; RowwiseParallel._prepare_input_fn moves the bias aside (mod._bias, mod.bias = None),
  _prepare_output_fn -> all_reduce_forward(outputs) (+ mod._bias).

The autograd Functions are transliterated from the same file. Only the collective calls are stood in for: with
one process, transformers returns early when device_mesh.size() == 1, so this stand-in keeps `tp` as the world
size and replaces dist.all_reduce(x) (in place) by dist.all_reduce on a gloo world-size-1 group (in place, no
allocation) and dist.all_gather(tensor_list, x) (writes into the list's preallocated tensors) by copy_ into them.
Neither allocates, as the real collectives allocate nothing in the caching allocator: the memory is the Python
code's clones, empty_likes and cats, which run as in transformers.
"""

import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def _group():
    if not dist.is_initialized():
        # a file:// store, as ddp.py: no TCP port that two runs at once (ctest -j, a second checkout) could both
        # want (a fixed MASTER_PORT failed with "Address already in use" when they did)
        store = tempfile.NamedTemporaryFile(prefix="trainmem-tp-store-", delete=False)
        store.close()
        os.unlink(store.name)
        dist.init_process_group("gloo", init_method="file://" + store.name, rank=0, world_size=1)
    return None  # the default group


def _all_reduce_(x):
    # in place, world size 1: the stand-in (torch 1.13's gloo reduces no bfloat16, so those are left as they are:
    # the values do not matter here, and an in-place collective allocates nothing either way)
    if x.dtype == torch.float32:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=_group())


class _AllReduceBackward(torch.autograd.Function):
    """Identity forward, all-reduce backward. Used before colwise layers (f in Megatron)."""

    @staticmethod
    def forward(ctx, x, world_size):
        ctx.world_size = world_size
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad_output = grad_output.clone()  # Clone to avoid in-place mutation (compile-compatible)
        _all_reduce_(grad_output)
        return grad_output, None


class _AllReduceForward(torch.autograd.Function):
    """All-reduce forward, identity backward. Used after rowwise layers (g in Megatron)."""

    @staticmethod
    def forward(ctx, x, world_size):
        x = x.clone()  # Clone to avoid in-place mutation (compile-compatible)
        _all_reduce_(x)
        return x

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _AllGather(torch.autograd.Function):
    """All-gather forward, split backward. Gathers sharded outputs."""

    @staticmethod
    def forward(ctx, x, world_size):
        ctx.world_size = world_size
        last_dim = x.dim() - 1
        rank = 0
        x = x.contiguous()
        tensor_list = [torch.empty_like(x) for _ in range(world_size)]
        tensor_list[rank] = x
        for i, t in enumerate(tensor_list):  # dist.all_gather(tensor_list, x, group=group): the stand-in
            if i != rank:
                t.copy_(x)
        return torch.cat(tensor_list, dim=last_dim).contiguous()

    @staticmethod
    def backward(ctx, grad_output):
        rank = 0
        chunks = torch.chunk(grad_output, ctx.world_size, dim=-1)  # _split_along_last_dim
        return chunks[rank].contiguous(), None


def _shard(t, dim, tp):
    n = t.shape[dim]
    size = -(-n // tp)  # math.ceil(n / world_size)
    return t.narrow(dim, 0, min(size, n)).clone()


def apply_tp(model, tp):
    """Shard `model` (a models.LlamaForCausalLM) for rank 0 of `tp` ranks and hook its planned modules."""
    if tp <= 1:
        return model
    for name, mod in model.named_modules():
        colwise = name.endswith(_COLWISE) and name.startswith("model.layers.")
        rowwise = name.endswith(_ROWWISE) and name.startswith("model.layers.")
        gather = name == "lm_head"
        if not (colwise or rowwise or gather):
            continue
        with torch.no_grad():
            if colwise or gather:
                mod.weight = nn.Parameter(_shard(mod.weight, -2, tp))
                if mod.bias is not None:
                    mod.bias = nn.Parameter(_shard(mod.bias, -1, tp))
            else:
                mod.weight = nn.Parameter(_shard(mod.weight, -1, tp))
        if colwise or gather:
            # ColwiseParallel._prepare_input_fn / _prepare_output_fn
            mod.register_forward_pre_hook(lambda m, inputs: _AllReduceBackward.apply(inputs[0], tp))
            if gather:
                mod.register_forward_hook(lambda m, inputs, outputs: _AllGather.apply(outputs, tp))
        else:
            def pre(m, inputs):  # RowwiseParallel._prepare_input_fn
                if hasattr(m, "bias") and m.bias is not None:
                    m._bias = m.bias
                    m.bias = None
                return inputs[0]

            def post(m, inputs, outputs):  # RowwiseParallel._prepare_output_fn
                outputs = _AllReduceForward.apply(outputs, tp)
                if hasattr(m, "_bias") and m._bias is not None:
                    outputs = outputs + m._bias
                return outputs

            mod.register_forward_pre_hook(pre)
            mod.register_forward_hook(post)
    return model
