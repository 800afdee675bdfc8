"""Reference implementations for the trainmem CPU oracle.

Plain torch.nn re-implementations of the models trainmem simulates, written to follow the real code paths
op by op (the op sequence decides what autograd saves), so that one training step run here with real PyTorch
reports the tensors that the real models would save.

  nanogpt   karpathy/nanoGPT model.py (GPT), manual attention path (torch < 2.0 has no SDPA: the float32
            causal-mask buffer `bias` (1,1,block,block) is registered), nn.GELU(), tied lm_head,
            F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-1).
  gpt2      transformers 5.x GPT2LMHeadModel, eager attention (Conv1D = addmm, gelu_new as its composite
            formula, division by a 0-dim tensor sqrt(D), additive float (B,1,T,T) causal mask).
  llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, mixtral, gemma3_text, starcoder2
            transformers 5.x *ForCausalLM with eager attention (gemma3_text: Gemma3ForCausalLM, its sliding and
            full layers with their own masks and rotary tables, q/k norms after the transpose; starcoder2:
            LayerNorms, biased projections, c_fc/c_proj MLP) (mixtral: 5.x fused 3-D experts with the eager
            experts loop, no router aux loss; its saved tensors depend on the routing, i.e. on the data).
  deepseek_v3
            transformers 5.x DeepseekV3ForCausalLM (LlamaForCausalLM with DeepseekV3Attention's latent attention
            and, from layer first_k_dense_replace on, DeepseekV3MoE: sigmoid group-limited router, the 3-D experts'
            eager loop, ungated shared experts), eager attention.
  gpt_neox  transformers 5.x GPTNeoXForCausalLM, eager attention.
  opt       transformers 5.x OPTForCausalLM, eager attention.
  phi       transformers 5.x PhiForCausalLM, eager attention (parallel attention + MLP off one LayerNorm, partial
            rotary, optional q/k LayerNorms, biased lm_head).
  bert      transformers 5.x BertForMaskedLM / BertForSequenceClassification / BertForTokenClassification
            (architectures[0]), eager attention, the collator's all-ones attention mask (no 4-D mask is made),
            token_type_ids passed; forward(input_ids, token_type_ids, attention_mask, labels) (make_inputs).
  roberta   transformers 5.x RobertaForMaskedLM / ...ForSequenceClassification / ...ForTokenClassification: the
            BERT layers, RobertaEmbeddings' position ids from padding_idx + 1, no token_type_ids in the batch;
            forward(input_ids, attention_mask, labels).
  falcon    transformers 5.x FalconForCausalLM, eager attention (FalconLinear's matmul then + bias; the
            new_decoder_architecture, multi_query and per-head query_key_value layouts; rotary or ALiBi, whose
            tensor and mask FalconModel builds by hand; the layer returns its attention weights).
  t5        transformers T5ForConditionalGeneration, eager (T5Attention's own path): encoder and decoder stacks,
            relative position bias from block 0, T5LayerNorm, relu or gated-gelu feed-forward, _shift_right(labels);
            forward(input_ids, attention_mask, labels).
  mlp       an nn.Sequential of Linear / ReLU / GELU / Sigmoid / LayerNorm (trainmem's "stack" impl).

Sources: /work/research/hf_*.md (quotes of the transformers source) and nanoGPT model.py. Every model's
forward(input_ids, labels) returns the scalar training loss (the mlp stack: forward(x) returns output.sum()).

build_model(config, device=None, frozen=(), checkpointing="none", checkpoint_every=1) builds a random-weight
model; device="meta" builds it without memory (for parameter counts of full-size models).

  frozen          parameter-name globs (fnmatch, `*` also matches dots; names as model.named_parameters() gives them,
                  which are transformers' names and trainmem's `params` names): matching parameters get
                  requires_grad=False (freeze_parameters).
  checkpointing   "none" | "reentrant" | "non-reentrant": transformers' gradient checkpointing
                  (GradientCheckpointingLayer.__call__, transformers >= 4.52): every checkpoint_every-th decoder layer
                  (index % checkpoint_every == 0) runs as
                  torch.utils.checkpoint.checkpoint(partial(layer.__call__, **kwargs), *args, use_reentrant=...):
                  the positional arguments (hidden_states; for GPT-2 also cache_position and the mask, which
                  GPT2Model passes positionally) are the checkpoint inputs, the keyword arguments (mask, cos/sin,
                  position_ids) ride in the partial. nanoGPT: x = checkpoint(block, x). Supported for nanogpt, gpt2
                  and the Llama family.
"""

import fnmatch
import functools
import math
from types import SimpleNamespace

import os
import sys

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # validate/: nanogpt.py
import nanogpt  # noqa: E402

# Qwen2MoeSparseMoeBlock calls F.sigmoid as transformers does; torch 1.13 warns that the alias is deprecated
warnings.filterwarnings("ignore", message="nn.functional.sigmoid is deprecated")

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral", "qwen2_moe", "qwen3_moe",
                "gemma3_text", "starcoder2", "deepseek_v3")
MODEL_TYPES = ("nanogpt", "gpt2", "gpt_neox", "opt", "phi", "falcon", "mlp", "t5", "bert", "roberta") + LLAMA_FAMILY


def _is_meta(device):
    return device is not None and torch.device(device).type == "meta"


def _normal_(p, std=0.02):
    if p.device.type != "meta":
        with torch.no_grad():
            p.normal_(0.0, std)
    return p


# ----------------------------------------------------------------------------------------------------------
# Activations: transformers ACT2FN (activations.py), each written as the code that runs.


class NewGELUActivation(nn.Module):
    """gelu_new: the composite formula (8 elementwise ops), exactly as transformers writes it."""

    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


class FastGELUActivation(nn.Module):
    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(input * 0.7978845608 * (1.0 + 0.044715 * input * input)))


class QuickGELUActivation(nn.Module):
    def forward(self, input):
        return input * torch.sigmoid(1.702 * input)


class GELUActivation(nn.Module):
    """"gelu": nn.functional.gelu (erf)."""

    def forward(self, input):
        return F.gelu(input)


class PytorchGELUTanh(nn.Module):
    """"gelu_pytorch_tanh": nn.functional.gelu(approximate="tanh")."""

    def forward(self, input):
        return F.gelu(input, approximate="tanh")


def act_fn(name):
    table = {
        "gelu_new": NewGELUActivation,
        "gelu_fast": FastGELUActivation,
        "quick_gelu": QuickGELUActivation,
        "gelu": GELUActivation,
        "gelu_pytorch_tanh": PytorchGELUTanh,
        "silu": nn.SiLU,
        "swish": nn.SiLU,
        "relu": nn.ReLU,
        "sigmoid": nn.Sigmoid,
        "tanh": nn.Tanh,
    }
    if name not in table:
        raise ValueError(f"unsupported activation {name!r}; one of {sorted(table)}")
    return table[name]()


# ----------------------------------------------------------------------------------------------------------
# Shared transformers pieces.


def keep_logits(model, hidden_states, labels):
    """*ForCausalLM.forward's logits_to_keep (transformers 5.x): slice_indices = slice(-logits_to_keep, None), or
    slice(0, None) for 0; the head runs on hidden_states[:, slice_indices, :]. Training with it (trainmem
    --logits-to-keep, as GRPO-style trainers use it): the loss is over the kept positions, labels[:, -k:] (a view).
    `model.logits_to_keep` is set by measure.py (0 by default)."""
    k = getattr(model, "logits_to_keep", 0)
    if not k:
        return hidden_states[:, slice(0, None), :], labels
    return hidden_states[:, slice(-k, None), :], (labels[:, -k:] if labels is not None else None)


def causal_lm_head(model, head, hidden_states, labels):
    """*ForCausalLM.forward after the model: logits = head(hidden_states[:, slice_indices, :]) (keep_logits); the
    logits as the model returns them without labels (inference), else transformers' ForCausalLMLoss."""
    kept, labels = keep_logits(model, hidden_states, labels)
    logits = head(kept)
    if labels is None:
        return logits  # inference (validate/cpu/inference.py): the logits as the model returns them
    return for_causal_lm_loss(logits, labels, vocab_size=model.vocab_size)


def for_causal_lm_loss(logits, labels, vocab_size, ignore_index=-100):
    """transformers loss/loss_utils.py ForCausalLMLoss (+ fixed_cross_entropy, reduction "mean")."""
    # Upcast to float if we need to compute the loss to avoid potential precision issues
    logits = logits.float()
    # Shift so that tokens < n predict n
    labels = F.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    # Flatten the tokens
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1)
    shift_labels = shift_labels.to(logits.device)
    return F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="mean")


def eager_causal_mask(batch, seq, dtype, device, sliding_window=None):
    """masking_utils (5.x) create_causal_mask / create_sliding_window_causal_mask for eager attention with no
    attention_mask: a bool (1,1,T,KV) expanded to (B,1,T,KV), then
    torch.where(mask, tensor(0.0, dtype), finfo(dtype).min) -> materialized float (B,1,T,KV) in dtype. KV is
    past + T while generating (GENERATION.cache), T otherwise."""
    past = GENERATION.cache.get_seq_length() if GENERATION.cache is not None else 0
    cache_position = torch.arange(past, past + seq, device=device)
    kv_arange = torch.arange(past + seq, device=device)
    q_idx = cache_position.view(1, 1, seq, 1)
    kv_idx = kv_arange.view(1, 1, 1, past + seq)
    mask = kv_idx <= q_idx
    if sliding_window is not None:
        mask = mask & (kv_idx > q_idx - sliding_window)
    mask = mask.expand(batch, -1, seq, past + seq)
    min_dtype = torch.finfo(dtype).min
    return torch.where(mask, torch.tensor(0.0, device=device, dtype=dtype), min_dtype)


class DynamicCache:
    """transformers 5.x cache_utils.DynamicCache of DynamicLayer's (validate/cpu/generate.py): per layer,
    `self.keys = torch.cat([self.keys, key_states], dim=-2)` (the first update cats onto torch.tensor([]))."""

    def __init__(self):
        self.keys, self.values = {}, {}

    def update(self, key_states, value_states, layer_idx):
        if layer_idx not in self.keys:  # DynamicLayer.lazy_initialization
            self.keys[layer_idx] = torch.tensor([], dtype=key_states.dtype, device=key_states.device)
            self.values[layer_idx] = torch.tensor([], dtype=key_states.dtype, device=key_states.device)
        self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key_states], dim=-2)
        self.values[layer_idx] = torch.cat([self.values[layer_idx], value_states], dim=-2)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self):
        return self.keys[0].shape[-2] if 0 in self.keys and self.keys[0].numel() else 0


# While generate.py runs a model: the cache its attention layers update (past_key_values) and the (B, q)
# position_ids generate() passes. Both None otherwise: the forward is the training and inference one.
GENERATION = SimpleNamespace(cache=None, position_ids=None, attention_mask=None)


def update_cache(key_states, value_states, layer_idx):
    """`key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)`."""
    if GENERATION.cache is None:
        return key_states, value_states
    return GENERATION.cache.update(key_states, value_states, layer_idx)


# ----------------------------------------------------------------------------------------------------------
# Gradient checkpointing and frozen parameters.

CHECKPOINT_MODES = ("none", "reentrant", "non-reentrant")
CHECKPOINTABLE = ("nanogpt", "gpt2") + LLAMA_FAMILY


class CheckpointSettings:
    """What PreTrainedModel.gradient_checkpointing_enable() sets on every GradientCheckpointingLayer:
    gradient_checkpointing=True and _gradient_checkpointing_func = partial(checkpoint, use_reentrant=...), here with
    every_n_layers. `log`, when a list, receives one record per checkpointed call (for the oracle's bookkeeping:
    which storages are checkpoint inputs, which ride in the partial, and which autograd node is the region's
    output). The record holds no tensor: storage identities pinned by C++ weak references, sizes, and the
    region's output and input autograd nodes (already owned by the graph), so it keeps no storage alive."""

    def __init__(self, mode="none", every=1):
        if mode not in CHECKPOINT_MODES:
            raise ValueError(f"checkpointing must be one of {CHECKPOINT_MODES}, got {mode!r}")
        if int(every) < 1:
            raise ValueError("checkpoint_every must be >= 1")
        self.mode = mode
        self.every = int(every)
        self.log = None

    def applies(self, index, module):
        return self.mode != "none" and module.training and index % self.every == 0


def _tensor_rows(prefix, obj):
    """(name, tensor) for every tensor in an argument (tensors, and tuples/lists of them)."""
    if torch.is_tensor(obj):
        return [(prefix, obj)]
    if isinstance(obj, (tuple, list)):
        rows = []
        for i, o in enumerate(obj):
            rows.extend(_tensor_rows(f"{prefix}[{i}]", o))
        return rows
    return []


def storage_id(t):
    """(identity, weak reference) of a tensor's storage: the StorageImpl address, pinned by a C++ weak reference
    (torch.multiprocessing.reductions.StorageWeakRef) so that no later storage can take the same address while
    the reference is held. (A data pointer is not an identity: a freed buffer's address is reused.)"""
    ref = StorageWeakRef(t.storage())
    return ref.cdata, ref


def _storage_row(name, t):
    key, ref = storage_id(t)
    return {"name": name, "storage": key, "storage_ref": ref, "storage_bytes": t.storage().nbytes(),
            "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
            "requires_grad": bool(t.requires_grad)}


def call_layer(settings, index, layer, *args, **kwargs):
    """transformers GradientCheckpointingLayer.__call__ (modeling_layers.py):
        if self.gradient_checkpointing and self.training:
            (use_cache / past_key_values forced off)
            return self._gradient_checkpointing_func(partial(super().__call__, **kwargs), *args)
        return super().__call__(*args, **kwargs)
    with _gradient_checkpointing_func = partial(torch.utils.checkpoint.checkpoint, use_reentrant=...)."""
    if settings is None or not settings.applies(index, layer):
        return layer(*args, **kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    for k in ("past_key_value", "past_key_values", "layer_past"):
        if kwargs.get(k) is not None:
            kwargs[k] = None
    reentrant = settings.mode == "reentrant"
    out = torch.utils.checkpoint.checkpoint(functools.partial(layer.__call__, **kwargs), *args,
                                            use_reentrant=reentrant)
    if settings.log is not None:
        arg_rows = []
        for i, a in enumerate(args):
            arg_rows.extend(_tensor_rows(f"arg{i}", a))
        kw_rows = []
        for k, v in kwargs.items():
            kw_rows.extend(_tensor_rows(k, v))
        settings.log.append({
            "layer": index,
            "mode": settings.mode,
            "args": [_storage_row(n, t) for n, t in arg_rows],
            "kwargs": [_storage_row(n, t) for n, t in kw_rows],
            # autograd nodes (not tensors): the region's output node, and the nodes that produced its inputs
            # (where a walk of the region's subgraph stops)
            "output_grad_fn": out.grad_fn if torch.is_tensor(out) else None,
            "input_grad_fns": [t.grad_fn for _, t in arg_rows if t.grad_fn is not None],
            "output_requires_grad": bool(torch.is_tensor(out) and out.requires_grad),
        })
    return out


def freeze_parameters(model, globs):
    """requires_grad_(False) on every parameter whose name (model.named_parameters(): tied weights under their
    first name, as transformers and trainmem's `params` list them) matches one of the fnmatch globs (`*` matches
    any characters, dots included). Returns the frozen names. A glob that matches nothing is an error."""
    globs = list(globs or ())
    if not globs:
        return []
    names = [n for n, _ in model.named_parameters()]
    for g in globs:
        if not any(fnmatch.fnmatchcase(n, g) for n in names):
            raise ValueError(f"freeze glob {g!r} matches no parameter (names: {', '.join(names[:6])}, ...)")
    frozen = []
    for n, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(n, g) for g in globs):
            p.requires_grad_(False)
            frozen.append(n)
    if len(frozen) == len(names):
        raise ValueError("every parameter is frozen: nothing is left to train")
    return frozen


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Llama family (full rotary)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def apply_rotary_pos_emb_phi3(q, k, cos, sin, unsqueeze_dim=1):
    """Phi3 (partial rotary; the cat runs even when rotary_dim == head_dim)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def apply_rotary_pos_emb_neox(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-NeoX (partial rotary, cat of the rotated and pass-through parts)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


class RotaryEmbedding(nn.Module):
    """LlamaRotaryEmbedding (5.x), default rope: inv_freq (dim/2,) fp32 buffer plus the late-5.x
    original_inv_freq clone; cos/sin computed once per forward under no_grad, cast to x.dtype."""

    def __init__(self, dim, base, device=None):
        super().__init__()
        dev = "meta" if _is_meta(device) else None
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        if dev:
            inv_freq = inv_freq.to(dev)
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        position_ids_expanded = position_ids[:, None, :].float()
        with torch.autocast(device_type="cpu", enabled=False):  # Force float32 (5.x LlamaRotaryEmbedding.forward)
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None):
    """Llama-family / GPT-NeoX / OPT eager kernel (5.x): matmul * scaling, [softcap], + mask,
    softmax(dtype=float32).to(query.dtype), dropout, matmul, transpose(1,2).contiguous()."""
    n_rep = getattr(module, "num_key_value_groups", 1)
    key_states = repeat_kv(key, n_rep)
    value_states = repeat_kv(value, n_rep)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if softcap is not None:
        attn_weights = attn_weights / softcap
        attn_weights = torch.tanh(attn_weights)
        attn_weights = attn_weights * softcap
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


# ----------------------------------------------------------------------------------------------------------
# Config resolution helpers.


def _get(cfg, keys, default=None):
    if isinstance(keys, str):
        keys = (keys,)
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def _rope_dict(cfg):
    for k in ("rope_parameters", "rope_scaling"):
        v = cfg.get(k)
        if isinstance(v, dict):
            return v
    return {}


def _rope_theta(cfg, default=10000.0):
    v = cfg.get("rope_theta")
    if v is None:
        v = _rope_dict(cfg).get("rope_theta")
    if v is None:
        v = cfg.get("rotary_emb_base")
    return float(v if v is not None else default)


# ----------------------------------------------------------------------------------------------------------
# nanoGPT (karpathy/nanoGPT model.py)


class NanoGPT(nanogpt.GPT):
    """nanoGPT's GPT (validate/nanogpt.py) on the manual attention path: torch 1.13 has no
    scaled_dot_product_attention, so the float32 causal-mask buffer `bias` is registered. Returns the loss."""

    uses_targets = True

    def __init__(self, cfg, device=None):
        c = nanogpt.GPTConfig(
            block_size=int(_get(cfg, "block_size", 1024)),
            vocab_size=int(_get(cfg, "vocab_size", 50304)),
            n_layer=int(_get(cfg, "n_layer", 12)),
            n_head=int(_get(cfg, "n_head", 12)),
            n_embd=int(_get(cfg, "n_embd", 768)),
            dropout=float(_get(cfg, "dropout", 0.0)),
            bias=bool(_get(cfg, "bias", True)),
        )
        super().__init__(c, flash=False, device=device)
        self.vocab_size = c.vocab_size
        self.checkpoint_settings = CheckpointSettings()

    def forward(self, idx, targets=None):
        if self.checkpoint_settings.mode == "none":
            logits, loss = super().forward(idx, targets)
            return logits if targets is None else loss  # inference: GPT.forward's last-position logits
        # GPT.forward with each `x = block(x)` as `x = checkpoint(block, x, use_reentrant=...)`
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for i, block in enumerate(self.transformer.h):
            x = call_layer(self.checkpoint_settings, i, block, x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return loss


# ----------------------------------------------------------------------------------------------------------
# GPT-2 (transformers 5.x modeling_gpt2.py, eager)


class Conv1D(nn.Module):
    def __init__(self, nf, nx, device=None):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(_normal_(torch.empty(nx, nf, device=device)))
        self.bias = nn.Parameter(torch.zeros(nf, device=device))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        x = x.view(size_out)
        return x


def gpt2_eager_attention_forward(module, query, key, value, attention_mask):
    attn_weights = torch.matmul(query, key.transpose(-1, -2))
    if module.scale_attn_weights:
        attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5, dtype=attn_weights.dtype,
                                                 device=attn_weights.device)
    if module.scale_attn_by_inverse_layer_idx:
        attn_weights = attn_weights / float(module.layer_idx + 1)
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1)
    # Downcast (if necessary) back to V's dtype (if in mixed-precision) -- No-Op otherwise
    attn_weights = attn_weights.type(value.dtype)
    attn_weights = module.attn_dropout(attn_weights)
    attn_output = torch.matmul(attn_weights, value)
    attn_output = attn_output.transpose(1, 2)
    return attn_output, attn_weights


class GPT2Attention(nn.Module):
    def __init__(self, c, layer_idx, device=None):
        super().__init__()
        self.embed_dim = c.n_embd
        self.num_heads = c.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        if self.head_dim * self.num_heads != self.embed_dim:
            raise ValueError("embed_dim must be divisible by num_heads")
        self.scale_attn_weights = c.scale_attn_weights
        self.scale_attn_by_inverse_layer_idx = c.scale_attn_by_inverse_layer_idx
        self.reorder_and_upcast_attn = c.reorder_and_upcast_attn
        self.layer_idx = layer_idx
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim, device)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim, device)
        self.attn_dropout = nn.Dropout(c.attn_pdrop)
        self.resid_dropout = nn.Dropout(c.resid_pdrop)
        self.is_causal = True

    def _upcast_and_reordered_attn(self, query, key, value, attention_mask):
        bsz, num_heads, q_seq_len, dk = query.size()
        _, _, k_seq_len, _ = key.size()
        attn_weights = torch.empty(bsz * num_heads, q_seq_len, k_seq_len, dtype=torch.float32, device=query.device)
        scale_factor = 1.0
        if self.scale_attn_weights:
            scale_factor /= float(value.size(-1)) ** 0.5
        if self.scale_attn_by_inverse_layer_idx:
            scale_factor /= float(self.layer_idx + 1)
        q, k = query.reshape(-1, q_seq_len, dk), key.transpose(-1, -2).reshape(-1, dk, k_seq_len)
        attn_weights = torch.baddbmm(attn_weights, q.float(), k.float(), beta=0, alpha=scale_factor)
        attn_weights = attn_weights.reshape(bsz, num_heads, q_seq_len, k_seq_len)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.type(value.dtype)
        attn_weights = self.attn_dropout(attn_weights)
        attn_output = torch.matmul(attn_weights, value)
        attn_output = attn_output.transpose(1, 2)
        return attn_output, attn_weights

    def forward(self, hidden_states, attention_mask):
        query_states, key_states, value_states = self.c_attn(hidden_states).split(self.split_size, dim=2)
        shape_kv = (*key_states.shape[:-1], -1, self.head_dim)
        key_states = key_states.view(shape_kv).transpose(1, 2)
        value_states = value_states.view(shape_kv).transpose(1, 2)
        shape_q = (*query_states.shape[:-1], -1, self.head_dim)
        query_states = query_states.view(shape_q).transpose(1, 2)
        key_states, value_states = update_cache(key_states, value_states, self.layer_idx)
        if self.reorder_and_upcast_attn:
            attn_output, attn_weights = self._upcast_and_reordered_attn(query_states, key_states, value_states,
                                                                        attention_mask)
        else:
            attn_output, attn_weights = gpt2_eager_attention_forward(self, query_states, key_states, value_states,
                                                                     attention_mask)
        attn_output = attn_output.reshape(*attn_output.shape[:-2], -1).contiguous()
        attn_output = self.c_proj(attn_output)
        attn_output = self.resid_dropout(attn_output)
        return attn_output, attn_weights


class GPT2MLP(nn.Module):
    def __init__(self, intermediate_size, c, device=None):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, c.n_embd, device)
        self.c_proj = Conv1D(c.n_embd, intermediate_size, device)
        self.act = act_fn(c.activation_function)
        self.dropout = nn.Dropout(c.resid_pdrop)

    def forward(self, hidden_states):
        hidden_states = self.c_fc(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.c_proj(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return hidden_states


class GPT2Block(nn.Module):
    def __init__(self, c, layer_idx, device=None):
        super().__init__()
        hidden_size = c.n_embd
        inner_dim = c.n_inner if c.n_inner is not None else 4 * hidden_size
        self.ln_1 = nn.LayerNorm(hidden_size, eps=c.layer_norm_epsilon, device=device)
        self.attn = GPT2Attention(c, layer_idx, device)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=c.layer_norm_epsilon, device=device)
        self.mlp = GPT2MLP(inner_dim, c, device)

    def forward(self, hidden_states, past_key_values=None, cache_position=None, attention_mask=None,
                encoder_hidden_states=None, encoder_attention_mask=None, use_cache=False, **kwargs):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        # transformers 5.x GPT2Block: both stay bound until the block returns (the weights matter under no_grad,
        # e.g. in a reentrant checkpoint's first forward, where nothing else keeps them)
        attn_output, self_attn_weights = self.attn(hidden_states, attention_mask)
        hidden_states = attn_output + residual
        residual = hidden_states
        hidden_states = self.ln_2(hidden_states)
        feed_forward_hidden_states = self.mlp(hidden_states)
        hidden_states = residual + feed_forward_hidden_states
        return hidden_states


class GPT2Model(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.embed_dim = c.n_embd
        self.wte = nn.Embedding(c.vocab_size, self.embed_dim, device=device)
        self.wpe = nn.Embedding(c.n_positions, self.embed_dim, device=device)
        self.drop = nn.Dropout(c.embd_pdrop)
        self.h = nn.ModuleList([GPT2Block(c, i, device) for i in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=c.layer_norm_epsilon, device=device)
        self.checkpoint_settings = CheckpointSettings()

    def forward(self, input_ids):
        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_shape[-1])
        batch_size = input_ids.shape[0]
        inputs_embeds = self.wte(input_ids)
        if GENERATION.position_ids is not None:  # passed by generate(): no cache_position is made
            cache_position, position_ids = None, GENERATION.position_ids
        else:
            cache_position = torch.arange(0, inputs_embeds.shape[1], device=inputs_embeds.device)
            position_ids = cache_position.unsqueeze(0)
        position_embeds = self.wpe(position_ids)
        hidden_states = inputs_embeds + position_embeds.to(inputs_embeds.device)
        causal_mask = eager_causal_mask(batch_size, input_shape[-1], inputs_embeds.dtype, inputs_embeds.device)
        hidden_states = self.drop(hidden_states)
        output_shape = (-1,) + input_shape[1:] + (hidden_states.size(-1),)
        for i, block in enumerate(self.h):
            # 5.x: block(hidden_states, past_key_values if not (gradient_checkpointing and training) else None,
            #            cache_position, causal_mask, encoder_hidden_states,  # positional for checkpointing
            #            encoder_attention_mask=..., use_cache=..., position_ids=position_ids, **kwargs)
            hidden_states = call_layer(self.checkpoint_settings, i, block, hidden_states, None, cache_position,
                                       causal_mask, None, encoder_attention_mask=None, use_cache=False,
                                       position_ids=position_ids)
        hidden_states = self.ln_f(hidden_states)
        hidden_states = hidden_states.view(output_shape)
        return hidden_states


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg, device=None):
        super().__init__()
        c = SimpleNamespace(
            vocab_size=int(_get(cfg, "vocab_size", 50257)),
            n_positions=int(_get(cfg, ("n_positions", "max_position_embeddings"), 1024)),
            n_embd=int(_get(cfg, ("n_embd", "hidden_size"), 768)),
            n_layer=int(_get(cfg, ("n_layer", "num_hidden_layers"), 12)),
            n_head=int(_get(cfg, ("n_head", "num_attention_heads"), 12)),
            n_inner=_get(cfg, "n_inner", None),
            activation_function=_get(cfg, "activation_function", "gelu_new"),
            resid_pdrop=float(_get(cfg, "resid_pdrop", 0.1)),
            embd_pdrop=float(_get(cfg, "embd_pdrop", 0.1)),
            attn_pdrop=float(_get(cfg, "attn_pdrop", 0.1)),
            layer_norm_epsilon=float(_get(cfg, "layer_norm_epsilon", 1e-5)),
            scale_attn_weights=bool(_get(cfg, "scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(_get(cfg, "scale_attn_by_inverse_layer_idx", False)),
            reorder_and_upcast_attn=bool(_get(cfg, "reorder_and_upcast_attn", False)),
            tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", True)),
        )
        if _get(cfg, "add_cross_attention", False):
            raise ValueError("add_cross_attention is not supported")
        self.config = c
        self.vocab_size = c.vocab_size
        self.transformer = GPT2Model(c, device)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False, device=device)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids, labels=None):
        hidden_states = self.transformer(input_ids)
        return causal_lm_head(self, self.lm_head, hidden_states, labels)


# ----------------------------------------------------------------------------------------------------------
# Llama family (transformers 5.x modeling_{llama,mistral,qwen2,qwen3,gemma,gemma2,phi3}.py, eager)


_LLAMA_DEFAULTS = {
    # type      vocab   hidden ffn    L   NH  KV    D     tied   act                  eps
    "llama":   (32000, 4096, 11008, 32, 32, None, None, False, "silu", 1e-6),
    "mistral": (32000, 4096, 14336, 32, 32, 8, None, False, "silu", 1e-6),
    "qwen2":   (151936, 4096, 22016, 32, 32, 32, None, False, "silu", 1e-6),
    "qwen3":   (151936, 4096, 22016, 32, 32, 32, 128, False, "silu", 1e-6),
    "gemma":   (256000, 3072, 24576, 28, 16, 16, 256, True, "gelu_pytorch_tanh", 1e-6),
    "gemma2":  (256000, 2304, 9216, 26, 8, 4, 256, True, "gelu_pytorch_tanh", 1e-6),
    "phi3":    (32064, 3072, 8192, 32, 32, None, None, False, "silu", 1e-5),
    "mixtral": (32000, 4096, 14336, 32, 32, 8, None, False, "silu", 1e-5),
    "gemma3_text": (262208, 2304, 9216, 26, 8, 4, 256, True, "gelu_pytorch_tanh", 1e-6),
    "starcoder2": (49152, 3072, 12288, 30, 24, 2, None, True, "gelu_pytorch_tanh", 1e-5),
    # configuration_qwen2_moe.py / configuration_qwen3_moe.py (5.x dataclass fields)
    "qwen2_moe": (151936, 2048, 5632, 24, 16, 16, None, False, "silu", 1e-6),
    "qwen3_moe": (151936, 2048, 6144, 24, 32, 4, None, False, "silu", 1e-6),
    # configuration_deepseek_v3.py (5.x @001f85b): vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    # num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, hidden_act="silu", rms_norm_eps=1e-6
    "deepseek_v3": (129280, 7168, 18432, 61, 128, 128, None, False, "silu", 1e-6),
}


def resolve_llama_config(cfg):
    t = cfg["model_type"]
    vocab, hidden, ffn, layers, heads, kv, hd, tied, act, eps = _LLAMA_DEFAULTS[t]
    c = SimpleNamespace(model_type=t)
    c.vocab_size = int(_get(cfg, "vocab_size", vocab))
    c.hidden_size = int(_get(cfg, "hidden_size", hidden))
    c.intermediate_size = int(_get(cfg, "intermediate_size", ffn))
    c.num_hidden_layers = int(_get(cfg, "num_hidden_layers", layers))
    c.num_attention_heads = int(_get(cfg, "num_attention_heads", heads))
    kvh = cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else kv
    c.num_key_value_heads = int(kvh if kvh is not None else c.num_attention_heads)
    hdv = cfg["head_dim"] if "head_dim" in cfg else hd
    c.head_dim = int(hdv if hdv is not None else c.hidden_size // c.num_attention_heads)
    if c.num_attention_heads % c.num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    c.tie_word_embeddings = bool(_get(cfg, "tie_word_embeddings", tied))
    if t in ("gemma2", "gemma3_text"):
        c.hidden_act = _get(cfg, "hidden_activation", act)
    else:
        c.hidden_act = _get(cfg, "hidden_act", act)
    c.rms_norm_eps = float(_get(cfg, "rms_norm_eps", eps))
    c.rope_theta = _rope_theta(cfg)
    # biases
    c.q_bias = c.k_bias = c.v_bias = c.o_bias = False
    c.mlp_bias = False
    if t == "qwen2":
        c.q_bias = c.k_bias = c.v_bias = True
    if t == "qwen2_moe":  # Qwen2MoeAttention: q/k/v bias=config.qkv_bias (default True), o_proj bias=False
        c.q_bias = c.k_bias = c.v_bias = bool(_get(cfg, "qkv_bias", True))
    if t in ("llama", "qwen3", "gemma", "gemma2", "gemma3_text", "qwen3_moe", "deepseek_v3"):
        ab = bool(_get(cfg, "attention_bias", False))
        c.q_bias = c.k_bias = c.v_bias = c.o_bias = ab
    if t == "llama":
        c.mlp_bias = bool(_get(cfg, "mlp_bias", False))
    c.starcoder2 = t == "starcoder2"
    if t == "starcoder2":
        # Starcoder2Config: use_bias=True, norm_epsilon=1e-5, residual_dropout=0.0, embedding_dropout=0.0
        ub = bool(_get(cfg, "use_bias", True))
        c.q_bias = c.k_bias = c.v_bias = c.o_bias = ub
        c.mlp_bias = ub
        c.rms_norm_eps = float(_get(cfg, "norm_epsilon", 1e-5))
        c.residual_dropout = float(_get(cfg, "residual_dropout", 0.0))
        c.embedding_dropout = float(_get(cfg, "embedding_dropout", 0.0))
    c.moe = t in ("mixtral", "qwen2_moe", "qwen3_moe")
    c.shared_expert_intermediate_size = 0
    c.decoder_sparse_step = 1
    c.mlp_only_layers = []
    if t == "mixtral":
        c.num_local_experts = int(_get(cfg, ("num_local_experts", "num_experts"), 8))
        c.num_experts_per_tok = int(_get(cfg, "num_experts_per_tok", 2))
        c.router_jitter_noise = float(_get(cfg, "router_jitter_noise", 0.0))
        c.moe_intermediate_size = c.intermediate_size
    elif c.moe:  # Qwen2MoeConfig / Qwen3MoeConfig
        q2 = t == "qwen2_moe"
        c.num_local_experts = int(_get(cfg, "num_experts", 60 if q2 else 128))
        c.num_experts_per_tok = int(_get(cfg, "num_experts_per_tok", 4 if q2 else 8))
        c.moe_intermediate_size = int(_get(cfg, "moe_intermediate_size", 1408 if q2 else 768))
        if q2:
            c.shared_expert_intermediate_size = int(_get(cfg, "shared_expert_intermediate_size", 5632))
        c.norm_topk_prob = bool(_get(cfg, "norm_topk_prob", False))
        c.decoder_sparse_step = int(_get(cfg, "decoder_sparse_step", 1))
        c.mlp_only_layers = list(cfg.get("mlp_only_layers") or [])
    c.mla = t == "deepseek_v3"
    if c.mla:
        # DeepseekV3Config: kv_lora_rank=512, q_lora_rank=1536 (None: q_proj), qk_rope_head_dim=64, v_head_dim=128,
        # qk_nope_head_dim=128, rope_interleave=True, n_routed_experts=256 (alias num_local_experts),
        # num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1, n_group=8, topk_group=4,
        # norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3
        for key, default in (("kv_lora_rank", 512), ("qk_rope_head_dim", 64), ("qk_nope_head_dim", 128),
                             ("v_head_dim", 128), ("num_experts_per_tok", 8), ("moe_intermediate_size", 2048),
                             ("n_shared_experts", 1), ("n_group", 8), ("topk_group", 4), ("first_k_dense_replace", 3)):
            setattr(c, key, int(_get(cfg, key, default)))
        c.q_lora_rank = cfg["q_lora_rank"] if "q_lora_rank" in cfg else 1536
        c.qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        c.rope_interleave = bool(_get(cfg, "rope_interleave", True))
        c.num_local_experts = int(_get(cfg, ("n_routed_experts", "num_local_experts"), 256))
        c.norm_topk_prob = bool(_get(cfg, "norm_topk_prob", True))
        c.routed_scaling_factor = float(_get(cfg, "routed_scaling_factor", 2.5))
    c.qk_norm = t in ("qwen3", "gemma3_text", "qwen3_moe")
    c.qk_norm_after_transpose = t == "gemma3_text"  # Gemma3Attention: q_norm(q.view(...).transpose(1, 2))
    c.fused = t == "phi3"
    c.gemma_norm = t in ("gemma", "gemma2", "gemma3_text")
    c.four_norms = t in ("gemma2", "gemma3_text")
    c.embed_scale = t in ("gemma", "gemma2", "gemma3_text")
    c.attention_dropout = float(_get(cfg, "attention_dropout", 0.0))
    c.resid_pdrop = float(_get(cfg, "resid_pdrop", 0.0)) if t == "phi3" else 0.0
    # rotary
    c.rotary_dim = c.head_dim
    if t == "phi3":
        f = cfg.get("partial_rotary_factor")
        if f is None:
            f = _rope_dict(cfg).get("partial_rotary_factor", 1.0)
        c.rotary_dim = int(c.head_dim * float(f))
    if c.mla:  # LlamaRotaryEmbedding's dim: config.head_dim = qk_rope_head_dim
        c.rotary_dim = c.qk_rope_head_dim
    # scaling / softcapping
    c.scaling = c.head_dim ** -0.5
    if c.mla:  # DeepseekV3Attention: qk_head_dim ** -0.5 (yarn's mscale changes the value only)
        c.scaling = c.qk_head_dim ** -0.5
    c.attn_softcap = None
    c.final_softcap = None
    if t == "gemma2":
        c.scaling = float(_get(cfg, "query_pre_attn_scalar", 256)) ** -0.5
        c.attn_softcap = cfg.get("attn_logit_softcapping", 50.0)
        c.final_softcap = cfg.get("final_logit_softcapping", 30.0)
    if t == "gemma3_text":
        # Gemma3TextConfig: query_pre_attn_scalar=256, attn_logit_softcapping=None, final_logit_softcapping=None
        c.scaling = float(_get(cfg, "query_pre_attn_scalar", 256)) ** -0.5
        c.attn_softcap = cfg.get("attn_logit_softcapping")
        c.final_softcap = cfg.get("final_logit_softcapping")
    # Gemma3TextConfig: layer_types=None -> "sliding_attention" if bool((i + 1) % sliding_window_pattern) else
    # "full_attention", sliding_window_pattern=6
    c.layer_types = None
    if t == "gemma3_text":
        c.layer_types = cfg.get("layer_types")
        if c.layer_types is None:
            pat = int(_get(cfg, "sliding_window_pattern", 6))
            c.layer_types = ["sliding_attention" if (i + 1) % pat else "full_attention"
                             for i in range(c.num_hidden_layers)]
        c.rope_local_base_freq = float(_get(cfg, "rope_local_base_freq", 10000.0))
    # sliding windows per layer (masks only; no saved tensor depends on them)
    sw = cfg.get("sliding_window", 4096 if t in ("mistral", "gemma2", "gemma3_text") else None)
    if t == "phi3":
        sw = None  # not applied to the eager mask here (masks are never saved; only their shape matters)
    if t in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        sw = None
    c.layer_windows = []
    for i in range(c.num_hidden_layers):
        if t == "gemma2":
            c.layer_windows.append(sw if (i + 1) % 2 else None)
        elif t == "gemma3_text":
            c.layer_windows.append(sw if c.layer_types[i] == "sliding_attention" else None)
        elif t in ("qwen2", "qwen3") and sw is not None:
            c.layer_windows.append(sw if i >= int(cfg.get("max_window_layers", 28)) else None)
        else:
            c.layer_windows.append(sw)
    pad = cfg.get("pad_token_id")
    c.pad_token_id = pad if isinstance(pad, int) and 0 <= pad < c.vocab_size else None
    return c


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, device=device))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        # Llama does x.to(float16) * w whilst Gemma is (x * w).to(float16)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class GemmaTextScaledWordEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, padding_idx, embed_scale=1.0, device=None):
        super().__init__(num_embeddings, embedding_dim, padding_idx, device=device)
        self.register_buffer("embed_scale", torch.tensor(embed_scale, device=device), persistent=False)

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


class LlamaMLP(nn.Module):
    def __init__(self, c, device=None, intermediate_size=None):
        super().__init__()
        f = c.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(c.hidden_size, f, bias=c.mlp_bias, device=device)
        self.up_proj = nn.Linear(c.hidden_size, f, bias=c.mlp_bias, device=device)
        self.down_proj = nn.Linear(f, c.hidden_size, bias=c.mlp_bias, device=device)
        self.act_fn = act_fn(c.hidden_act)

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class Phi3MLP(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False, device=device)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False, device=device)
        self.activation_fn = act_fn(c.hidden_act)

    def forward(self, hidden_states):
        up_states = self.gate_up_proj(hidden_states)
        gate, up_states = up_states.chunk(2, dim=-1)
        up_states = up_states * self.activation_fn(gate)
        return self.down_proj(up_states)


class MixtralTopKRouter(nn.Module):
    """5.x: F.linear -> softmax(logits.float()) -> topk -> renormalize (top-k weights stay float32)."""

    def __init__(self, c, device=None):
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.num_experts = c.num_local_experts
        self.hidden_dim = c.hidden_size
        self.weight = nn.Parameter(_normal_(torch.empty(self.num_experts, self.hidden_dim, device=device)))

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        forced = getattr(self, "forced_indices", None)
        if forced is not None:
            # The test's routing (set_moe_routing): the experts topk picked are overwritten through .data, which
            # the registry and autograd do not see (no new storage, no version bump); every op, shape and
            # lifetime stays transformers', only the expert each (token, slot) goes to is the test's.
            router_indices.data.copy_(forced)
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        router_scores = router_top_value
        return router_logits, router_scores, router_indices


def moe_routing_indices(tokens, top_k, num_experts, mode):
    """The (tokens, top_k) expert indices of trainmem's --moe-routing assumption. balanced: assignment
    a = token * top_k + slot goes to expert a % num_experts (a token's experts are distinct when top_k <=
    num_experts; expert e gets floor(tokens*top_k / E) assignments, one more when e < (tokens*top_k) % E);
    worst: every token goes to experts 0..top_k-1."""
    if mode == "balanced":
        return (torch.arange(tokens * top_k, dtype=torch.int64) % num_experts).view(tokens, top_k)
    if mode == "worst":
        return torch.arange(top_k, dtype=torch.int64).expand(tokens, top_k).contiguous()
    raise ValueError(f"moe routing {mode!r}: expected balanced or worst")


class Qwen2MoeTopKRouter(nn.Module):
    """modular_qwen2_moe.py (5.x); Qwen3MoeTopKRouter inherits it. The logits are rebound to the float32
    probabilities, which are returned; the top-k weights are renormalized only with norm_topk_prob."""

    def __init__(self, c, device=None):
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.num_experts = c.num_local_experts
        self.norm_topk_prob = c.norm_topk_prob
        self.hidden_dim = c.hidden_size
        self.weight = nn.Parameter(_normal_(torch.empty(self.num_experts, self.hidden_dim, device=device)))

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_logits = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
        router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)
        forced = getattr(self, "forced_indices", None)
        if forced is not None:  # the test's routing (set_moe_routing), as in MixtralTopKRouter
            router_indices.data.copy_(forced)
        if self.norm_topk_prob:
            router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        router_top_value = router_top_value.to(router_logits.dtype)
        router_scores = router_top_value
        return router_logits, router_scores, router_indices


class Qwen2MoeSparseMoeBlock(nn.Module):
    """modular_qwen2_moe.py (5.x): gate, experts, shared_expert (Qwen2MoeMLP = LlamaMLP's layout and forward),
    shared_expert_gate. Qwen3MoeSparseMoeBlock: experts registered before gate, no shared expert."""

    def __init__(self, c, device=None):
        super().__init__()
        self.qwen3 = c.model_type == "qwen3_moe"
        if self.qwen3:
            self.experts = MixtralExperts(c, device)
            self.gate = Qwen2MoeTopKRouter(c, device)
        else:
            self.gate = Qwen2MoeTopKRouter(c, device)
            self.experts = MixtralExperts(c, device)
            self.shared_expert = LlamaMLP(c, device, intermediate_size=c.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False, device=device)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states_reshaped = hidden_states.view(-1, hidden_dim)
        if self.qwen3:
            _, routing_weights, selected_experts = self.gate(hidden_states_reshaped)
            final_hidden_states = self.experts(hidden_states_reshaped, selected_experts, routing_weights)
            return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        shared_expert_output = self.shared_expert(hidden_states_reshaped)
        _, routing_weights, selected_experts = self.gate(hidden_states_reshaped)
        expert_output = self.experts(hidden_states_reshaped, selected_experts, routing_weights)
        shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states_reshaped)) * shared_expert_output
        expert_output += shared_expert_output
        expert_output = expert_output.reshape(batch_size, sequence_length, hidden_dim)
        return expert_output


def set_moe_routing(model, tokens, mode):
    """Makes every router of `model` route `tokens` tokens as trainmem's --moe-routing `mode` assumes. Call it
    before the measured step: the index tensors are made here, outside it."""
    for mod in model.modules():
        if isinstance(mod, MOE_ROUTERS):
            mod.forced_indices = None if mode is None else moe_routing_indices(tokens, mod.top_k, mod.num_experts, mode)


class _GroupedMM(torch.autograd.Function):
    """torch._grouped_mm(x (S, in), w (E, in, out), offs) for torch 1.13, which lacks it: one (S, out) output
    written group by group (mm out=, no other storage); saves x when w needs a gradient, w when x does, and offs
    (derivatives.yaml: self: _grouped_mm_mat1_backward(grad, mat2, ...), mat2: _grouped_mm_mat2_backward(grad,
    self, ...)); the backward makes w's gradient first, in w's layout (FunctionsManual.cpp
    _grouped_mm_mat2_backward's column-major branch, w being a parameter's transpose), then x's."""

    @staticmethod
    def forward(ctx, x, w, offs):
        out = x.new_empty((x.shape[0], w.shape[2]))
        start = 0
        for e in range(w.shape[0]):
            end = int(offs[e])
            if end > start:
                torch.mm(x[start:end], w[e], out=out[start:end])
            start = end
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w if ctx.needs_input_grad[0] else None, offs)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        gx = gw = None
        bounds = []
        start = 0
        for e in range(offs.shape[0]):
            end = int(offs[e])
            bounds.append((e, start, end))
            start = end
        if ctx.needs_input_grad[1]:
            # zeros in w's layout (w is a parameter's transpose(-2, -1)): experts without tokens get zeros
            gw = torch.zeros((w.shape[0], w.shape[2], w.shape[1]), dtype=grad.dtype).transpose(-2, -1)
            for e, a, b in bounds:
                if b > a:
                    torch.mm(x[a:b].t(), grad[a:b], out=gw[e])
        if ctx.needs_input_grad[0]:
            gx = torch.empty((grad.shape[0], w.shape[1]), dtype=grad.dtype)
            for e, a, b in bounds:
                if b > a:
                    torch.mm(grad[a:b], w[e].t(), out=gx[a:b])
        return gx, gw, None


def grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """integrations/moe.py @0261a46 (experts_implementation="grouped_mm"), with _GroupedMM for torch._grouped_mm."""
    device = hidden_states.device
    num_top_k = top_k_index.size(-1)
    num_tokens = hidden_states.size(0)
    num_experts = self.gate_up_proj.size(0)
    final_hidden_states = torch.zeros_like(hidden_states)
    expert_ids = top_k_index.reshape(-1)
    token_idx = torch.arange(num_tokens, device=device).unsqueeze(1).expand(-1, num_top_k).reshape(-1)
    perm = torch.argsort(expert_ids, stable=True)
    inv_perm = torch.argsort(perm, stable=True)
    sample_weights = top_k_weights.reshape(-1)
    current_hidden_states = hidden_states[token_idx]
    expert_ids_g = expert_ids[perm]
    sample_weights_g = sample_weights[perm]
    current_states_g = current_hidden_states[perm]
    num_tokens_per_expert = torch.histc(expert_ids_g.float(), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    gate_up_out = _GroupedMM.apply(current_states_g, self.gate_up_proj.transpose(-2, -1), offsets)
    gate, up = gate_up_out.chunk(2, dim=-1)
    hidden_after_activation = self.act_fn(gate) * up
    out_per_sample_g = _GroupedMM.apply(hidden_after_activation, self.down_proj.transpose(-2, -1), offsets)
    out_per_sample_g = out_per_sample_g * sample_weights_g.unsqueeze(-1)
    out_per_sample = out_per_sample_g[inv_perm]
    final_hidden_states.index_add_(0, token_idx, out_per_sample.to(final_hidden_states.dtype))
    return final_hidden_states


def set_moe_experts(model, implementation):
    """experts_implementation of every experts module: "eager" (the loop) or "grouped_mm"."""
    for mod in model.modules():
        if isinstance(mod, MixtralExperts):
            mod.experts_implementation = implementation


class MixtralExperts(nn.Module):
    """5.x fused 3-D experts, eager implementation (grouped_mm does not exist in torch 1.13)."""

    def __init__(self, c, device=None):
        super().__init__()
        self.num_experts = c.num_local_experts
        self.hidden_dim = c.hidden_size
        self.intermediate_dim = c.moe_intermediate_size  # qwen*_moe: config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(_normal_(torch.empty(self.num_experts, 2 * self.intermediate_dim,
                                                              self.hidden_dim, device=device)))
        self.down_proj = nn.Parameter(_normal_(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim,
                                                           device=device)))
        self.act_fn = act_fn(c.hidden_act)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if getattr(self, "experts_implementation", "eager") == "grouped_mm":  # use_experts_implementation's dispatch
            return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # under expert parallelism (ep_shard.py) the ep_router's sentinel index num_experts is one more class
            classes = self.num_experts + getattr(self, "ep_sentinel", 0)
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=classes)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current_hidden_states = self.act_fn(gate) * up
            current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.jitter_noise = c.router_jitter_noise
        self.gate = MixtralTopKRouter(c, device)
        self.experts = MixtralExperts(c, device)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        _, top_k_weights, top_k_index = self.gate(hidden_states)
        hidden_states = self.experts(hidden_states, top_k_index, top_k_weights)
        hidden_states = hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return hidden_states


class DeepseekV3TopkRouter(nn.Module):
    """modular_deepseek_v3.py (5.x @000c33f): weight (E, C) then the e_score_correction_bias buffer (E,);
    forward is the float32 linear only (the routing is DeepseekV3MoE.route_tokens_to_experts)."""

    def __init__(self, c, device=None):
        super().__init__()
        self.hidden_size = c.hidden_size
        self.n_routed_experts = c.num_local_experts
        self.weight = nn.Parameter(_normal_(torch.empty((self.n_routed_experts, c.hidden_size), device=device)))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_routed_experts, device=device))

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_size)
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        return router_logits


class DeepseekV3MoE(nn.Module):
    """modular_deepseek_v3.py (5.x @000c33f): experts (DeepseekV3NaiveMoe = MixtralExperts with
    moe_intermediate_size), gate, shared_experts (DeepseekV3MLP = Qwen2MoeMLP, LlamaMLP's layout and forward)."""

    def __init__(self, c, device=None):
        super().__init__()
        self.experts = MixtralExperts(c, device)
        self.gate = DeepseekV3TopkRouter(c, device)
        self.shared_experts = LlamaMLP(c, device, intermediate_size=c.moe_intermediate_size * c.n_shared_experts)
        self.n_routed_experts = c.num_local_experts
        self.n_group = c.n_group
        self.topk_group = c.topk_group
        self.norm_topk_prob = c.norm_topk_prob
        self.routed_scaling_factor = c.routed_scaling_factor
        self.top_k = c.num_experts_per_tok
        self.num_experts = c.num_local_experts  # set_moe_routing
        self.forced_indices = None

    def route_tokens_to_experts(self, router_logits):
        router_logits = router_logits.sigmoid()
        router_logits_for_choice = router_logits + self.gate.e_score_correction_bias
        group_scores = (
            router_logits_for_choice.view(-1, self.n_group, self.n_routed_experts // self.n_group)
            .topk(2, dim=-1)[0]
            .sum(dim=-1)
        )
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, self.n_group, self.n_routed_experts // self.n_group)
            .reshape(-1, self.n_routed_experts)
        )
        scores_for_choice = router_logits_for_choice.masked_fill(~score_mask.bool(), 0.0)
        topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        if self.forced_indices is not None:
            # the test's routing (set_moe_routing), as in MixtralTopKRouter: overwritten through .data
            topk_indices.data.copy_(self.forced_indices)
        topk_weights = router_logits.gather(1, topk_indices)
        if self.norm_topk_prob:
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            topk_weights /= denominator
        topk_weights = topk_weights * self.routed_scaling_factor
        return topk_indices, topk_weights

    def forward(self, hidden_states):
        residuals = hidden_states
        orig_shape = hidden_states.shape
        router_logits = self.gate(hidden_states)
        topk_indices, topk_weights = self.route_tokens_to_experts(router_logits)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        hidden_states = hidden_states + self.shared_experts(residuals)
        return hidden_states


def apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1):
    """modular_deepseek_v3.py: de-interleave q and k (view, transpose, reshape: copies), then the Llama rotation."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class DeepseekV3Attention(nn.Module):
    """modular_deepseek_v3.py (5.x @000c33f) multi-head latent attention, eager."""

    def __init__(self, c, layer_idx, device=None):
        super().__init__()
        self.config = c
        self.layer_idx = layer_idx
        self.num_key_value_groups = c.num_attention_heads // c.num_key_value_heads
        self.attention_dropout = c.attention_dropout
        self.sliding_window = None  # LlamaModel's mask lookup
        C, H, ab = c.hidden_size, c.num_attention_heads, c.o_bias  # attention_bias
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(C, H * c.qk_head_dim, bias=False, device=device)
        else:
            self.q_a_proj = nn.Linear(C, c.q_lora_rank, bias=ab, device=device)
            self.q_a_layernorm = LlamaRMSNorm(c.q_lora_rank, device=device)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * c.qk_head_dim, bias=False, device=device)
        self.kv_a_proj_with_mqa = nn.Linear(C, c.kv_lora_rank + c.qk_rope_head_dim, bias=ab, device=device)
        self.kv_a_layernorm = LlamaRMSNorm(c.kv_lora_rank, device=device)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False, device=device)
        self.o_proj = nn.Linear(H * c.v_head_dim, C, bias=ab, device=device)
        self.scaling = c.scaling

    def forward(self, hidden_states, position_embeddings, attention_mask):
        c = self.config
        batch_size, seq_length = hidden_states.shape[:-1]
        query_shape = (batch_size, seq_length, -1, c.qk_head_dim)
        key_shape = (batch_size, seq_length, -1, c.qk_nope_head_dim + c.v_head_dim)
        if c.q_lora_rank is None:
            q_states = self.q_proj(hidden_states)
        else:
            q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_states = q_states.view(query_shape).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        k_pass, k_rot = torch.split(compressed_kv, [c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        k_pass = self.kv_b_proj(self.kv_a_layernorm(k_pass)).view(key_shape).transpose(1, 2)
        k_pass, value_states = torch.split(k_pass, [c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_rot = k_rot.view(batch_size, 1, seq_length, c.qk_rope_head_dim)
        cos, sin = position_embeddings
        if c.rope_interleave:
            q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        else:
            q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
        k_rot = k_rot.expand(*k_pass.shape[:-1], -1)
        query_states = torch.cat((q_pass, q_rot), dim=-1)
        key_states = torch.cat((k_pass, k_rot), dim=-1)
        key_states, value_states = update_cache(key_states, value_states, self.layer_idx)
        attn_output, attn_weights = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, dropout=0.0 if not self.training else self.attention_dropout)
        attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


# The modules whose forced_indices set_moe_routing sets (each has top_k and num_experts).
MOE_ROUTERS = (MixtralTopKRouter, Qwen2MoeTopKRouter, DeepseekV3MoE)


class Starcoder2MLP(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.c_fc = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, device=device)
        self.c_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, device=device)
        self.act = act_fn(c.hidden_act)
        self.residual_dropout = c.residual_dropout

    def forward(self, hidden_states):
        hidden_states = self.c_fc(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.c_proj(hidden_states)
        hidden_states = F.dropout(hidden_states, p=self.residual_dropout, training=self.training)
        return hidden_states


def _layer_norm_cls(c):
    """The decoder's norm: nn.LayerNorm for starcoder2 (with bias), GemmaRMSNorm for the Gemmas, else LlamaRMSNorm."""
    if c.starcoder2:
        return lambda dim, eps, device=None: nn.LayerNorm(dim, eps=eps, device=device)
    return GemmaRMSNorm if c.gemma_norm else LlamaRMSNorm


class LlamaAttention(nn.Module):
    def __init__(self, c, layer_idx, device=None):
        super().__init__()
        self.config = c
        self.layer_idx = layer_idx
        self.head_dim = c.head_dim
        self.num_key_value_groups = c.num_attention_heads // c.num_key_value_heads
        self.num_key_value_heads = c.num_key_value_heads
        self.scaling = c.scaling
        self.attention_dropout = c.attention_dropout
        self.softcap = c.attn_softcap
        self.sliding_window = c.layer_windows[layer_idx]
        H, KV, D, C = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
        if c.fused:
            op_size = H * D + 2 * (KV * D)
            self.o_proj = nn.Linear(H * D, C, bias=False, device=device)
            self.qkv_proj = nn.Linear(C, op_size, bias=False, device=device)
        else:
            self.q_proj = nn.Linear(C, H * D, bias=c.q_bias, device=device)
            self.k_proj = nn.Linear(C, KV * D, bias=c.k_bias, device=device)
            self.v_proj = nn.Linear(C, KV * D, bias=c.v_bias, device=device)
            self.o_proj = nn.Linear(H * D, C, bias=c.o_bias, device=device)
        if c.qk_norm:
            QKNorm = GemmaRMSNorm if c.gemma_norm else LlamaRMSNorm  # Gemma3RMSNorm is GemmaRMSNorm's code
            self.q_norm = QKNorm(D, eps=c.rms_norm_eps, device=device)
            self.k_norm = QKNorm(D, eps=c.rms_norm_eps, device=device)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        c = self.config
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        if c.fused:
            qkv = self.qkv_proj(hidden_states)
            query_pos = c.num_attention_heads * self.head_dim
            query_states = qkv[..., :query_pos]
            key_states = qkv[..., query_pos: query_pos + self.num_key_value_heads * self.head_dim]
            value_states = qkv[..., query_pos + self.num_key_value_heads * self.head_dim:]
            query_states = query_states.view(hidden_shape).transpose(1, 2)
            key_states = key_states.view(hidden_shape).transpose(1, 2)
            value_states = value_states.view(hidden_shape).transpose(1, 2)
        elif c.qk_norm_after_transpose:  # gemma3_text
            query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            query_states = self.q_norm(query_states)
            key_states = self.k_norm(key_states)
        elif c.qk_norm:
            query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        else:
            query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        if c.fused:
            query_states, key_states = apply_rotary_pos_emb_phi3(query_states, key_states, cos, sin)
        else:
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states, value_states = update_cache(key_states, value_states, self.layer_idx)
        attn_output, attn_weights = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, dropout=0.0 if not self.training else self.attention_dropout,
            softcap=self.softcap)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        if c.starcoder2:  # Starcoder2Attention: "diff with Llama"
            attn_output = F.dropout(attn_output, p=c.residual_dropout, training=self.training)
        return attn_output, attn_weights


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c, layer_idx, device=None):
        super().__init__()
        self.config = c
        self.self_attn = DeepseekV3Attention(c, layer_idx, device) if c.mla else LlamaAttention(c, layer_idx, device)
        # DeepseekV3DecoderLayer: DeepseekV3MoE if layer_idx >= config.first_k_dense_replace else DeepseekV3MLP
        # Qwen2MoeDecoderLayer: sparse when layer_idx not in mlp_only_layers and (layer_idx + 1) % decoder_sparse_step == 0
        sparse = c.moe and layer_idx not in c.mlp_only_layers and (layer_idx + 1) % c.decoder_sparse_step == 0
        if c.mla and layer_idx >= c.first_k_dense_replace:
            self.mlp = DeepseekV3MoE(c, device)
        elif sparse and c.model_type == "mixtral":
            self.mlp = MixtralSparseMoeBlock(c, device)
        elif sparse:
            self.mlp = Qwen2MoeSparseMoeBlock(c, device)
        else:
            self.mlp = Phi3MLP(c, device) if c.fused else (Starcoder2MLP(c, device) if c.starcoder2 else LlamaMLP(c, device))
        Norm = _layer_norm_cls(c)
        self.input_layernorm = Norm(c.hidden_size, eps=c.rms_norm_eps, device=device)
        self.post_attention_layernorm = Norm(c.hidden_size, eps=c.rms_norm_eps, device=device)
        if c.four_norms:
            self.pre_feedforward_layernorm = Norm(c.hidden_size, eps=c.rms_norm_eps, device=device)
            self.post_feedforward_layernorm = Norm(c.hidden_size, eps=c.rms_norm_eps, device=device)
        if c.fused:
            self.resid_attn_dropout = nn.Dropout(c.resid_pdrop)
            self.resid_mlp_dropout = nn.Dropout(c.resid_pdrop)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        c = self.config
        mask = attention_mask
        if c.four_norms:  # gemma2
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states, position_embeddings, mask)
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.pre_feedforward_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = self.post_feedforward_layernorm(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # transformers 5.x: `hidden_states, _ = self.self_attn(...)`: `_` keeps the attention weights bound until
        # the layer returns (under no_grad nothing else does)
        hidden_states, _ = self.self_attn(hidden_states, position_embeddings, mask)
        if c.fused:  # phi3
            hidden_states = residual + self.resid_attn_dropout(hidden_states)
        else:
            hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        if c.fused:
            hidden_states = residual + self.resid_mlp_dropout(hidden_states)
        else:
            hidden_states = residual + hidden_states
        return hidden_states


class Gemma3RotaryEmbedding(nn.Module):
    """Gemma3RotaryEmbedding (5.x): per layer type of config.layer_types, buffers f"{layer_type}_inv_freq" and
    f"{layer_type}_original_inv_freq" (a clone), persistent=False; the full-attention table from rope_theta (and
    rope_scaling, default here), the sliding one from rope_local_base_freq. transformers walks set(layer_types)
    (Python string-hash order); here the order of first use, as trainmem lists them. forward(x, position_ids,
    layer_type) is LlamaRotaryEmbedding's on that type's table."""

    def __init__(self, c, device=None):
        super().__init__()
        dev = "meta" if _is_meta(device) else None
        self.order = []
        for lt in c.layer_types:
            if lt in self.order:
                continue
            self.order.append(lt)
            base = c.rope_local_base_freq if lt == "sliding_attention" else c.rope_theta
            dim = c.rotary_dim
            inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
            if dev:
                inv = inv.to(dev)
            self.register_buffer(f"{lt}_inv_freq", inv, persistent=False)
            self.register_buffer(f"{lt}_original_inv_freq", inv.clone(), persistent=False)
        self.attention_scaling = 1.0

    @torch.no_grad()
    def forward(self, x, position_ids, layer_type):
        inv_freq = getattr(self, f"{layer_type}_inv_freq")
        inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        position_ids_expanded = position_ids[:, None, :].float()
        with torch.autocast(device_type="cpu", enabled=False):  # Force float32, as LlamaRotaryEmbedding
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class LlamaModel(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.config = c
        if c.embed_scale:
            self.embed_tokens = GemmaTextScaledWordEmbedding(c.vocab_size, c.hidden_size, c.pad_token_id,
                                                             embed_scale=c.hidden_size ** 0.5, device=device)
        else:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, c.pad_token_id, device=device)
        self.layers = nn.ModuleList([LlamaDecoderLayer(c, i, device) for i in range(c.num_hidden_layers)])
        Norm = _layer_norm_cls(c)
        self.norm = Norm(c.hidden_size, eps=c.rms_norm_eps, device=device)
        if c.layer_types is not None:
            self.rotary_emb = Gemma3RotaryEmbedding(c, device=device)
        else:
            self.rotary_emb = RotaryEmbedding(c.rotary_dim, c.rope_theta, device=device)
        self.checkpoint_settings = CheckpointSettings()

    def forward(self, input_ids):
        inputs_embeds = self.embed_tokens(input_ids)
        B, T = inputs_embeds.shape[:2]
        if GENERATION.position_ids is not None:  # passed by generate()
            position_ids = GENERATION.position_ids
        else:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + 0
            position_ids = position_ids.unsqueeze(0)
        if self.config.layer_types is not None:
            return self._gemma3_forward(inputs_embeds, position_ids)
        masks = {}
        for w in set(self.config.layer_windows):
            masks[w] = eager_causal_mask(B, T, inputs_embeds.dtype, inputs_embeds.device, sliding_window=w)
        hidden_states = inputs_embeds
        if self.config.starcoder2:  # Starcoder2Model: "main diff with Llama"
            hidden_states = F.dropout(hidden_states, p=self.config.embedding_dropout, training=self.training)
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for i, layer in enumerate(self.layers):
            # 5.x: decoder_layer(hidden_states, attention_mask=causal_mask_mapping[layer.attention_type],
            #                    position_embeddings=position_embeddings, position_ids=position_ids, ...)
            hidden_states = call_layer(self.checkpoint_settings, i, layer, hidden_states,
                                       attention_mask=masks[layer.self_attn.sliding_window],
                                       position_embeddings=position_embeddings, position_ids=position_ids)
        hidden_states = self.norm(hidden_states)
        return hidden_states

    def _gemma3_forward(self, inputs_embeds, position_ids):
        """Gemma3TextModel.forward (5.x) from the masks on: both masks made (full, then sliding), one rotary
        table per layer type, each layer called with its type's mask and table."""
        B, T = inputs_embeds.shape[:2]
        sw = next((w for w in self.config.layer_windows if w is not None), None)
        causal_mask_mapping = {
            "full_attention": eager_causal_mask(B, T, inputs_embeds.dtype, inputs_embeds.device),
            "sliding_attention": eager_causal_mask(B, T, inputs_embeds.dtype, inputs_embeds.device,
                                                   sliding_window=sw if sw is not None else 4096),
        }
        hidden_states = inputs_embeds
        position_embeddings = {}
        for layer_type in self.rotary_emb.order:
            position_embeddings[layer_type] = self.rotary_emb(hidden_states, position_ids, layer_type)
        for i, layer in enumerate(self.layers):
            lt = self.config.layer_types[i]
            hidden_states = call_layer(self.checkpoint_settings, i, layer, hidden_states,
                                       attention_mask=causal_mask_mapping[lt],
                                       position_embeddings=position_embeddings[lt], position_ids=position_ids)
        hidden_states = self.norm(hidden_states)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg, device=None):
        super().__init__()
        c = resolve_llama_config(cfg)
        self.config = c
        self.vocab_size = c.vocab_size
        self.model = LlamaModel(c, device)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device=device)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, labels=None):
        hidden_states = self.model(input_ids)
        kept, labels = keep_logits(self, hidden_states, labels)
        logits = self.lm_head(kept)
        if self.config.final_softcap is not None:
            logits = logits / self.config.final_softcap
            logits = torch.tanh(logits)
            logits = logits * self.config.final_softcap
        if labels is None:
            return logits  # inference (validate/cpu/inference.py): the logits as the model returns them
        return for_causal_lm_loss(logits, labels, vocab_size=self.vocab_size)


class LlamaForSequenceClassification(nn.Module):
    """GenericForSequenceClassification (modeling_layers.py, 5.x) over the Llama-shaped model: score without bias
    over every position, pooled at the last non-pad token (config.pad_token_id given), and
    ForSequenceClassificationLoss's single_label_classification (loss_utils.py fixed_cross_entropy). The batch:
    input_ids and labels (B,) (make_inputs)."""

    def __init__(self, cfg, device=None):
        super().__init__()
        c = resolve_llama_config(cfg)
        self.config = c
        self.vocab_size = c.vocab_size
        self.pad_token_id = int(cfg["pad_token_id"])
        id2label = cfg.get("id2label")
        self.num_labels = len(id2label) if id2label else int(cfg.get("num_labels", 2))
        self.model = LlamaModel(c, device)
        self.score = nn.Linear(c.hidden_size, self.num_labels, bias=False, device=device)

    def make_inputs(self, batch, seq, generator, labels=True):
        ids = torch.randint(0, self.vocab_size, (batch, seq), dtype=torch.int64, generator=generator)
        if not labels:
            return [ids]
        return [ids, torch.randint(0, self.num_labels, (batch,), dtype=torch.int64, generator=generator)]

    def forward(self, input_ids, labels=None):
        hidden_states = self.model(input_ids)
        logits = self.score(hidden_states)
        batch_size = input_ids.shape[0]
        non_pad_mask = (input_ids != self.pad_token_id).to(logits.device, torch.int32)
        token_indices = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
        last_non_pad_token = (token_indices * non_pad_mask).argmax(-1)
        pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_non_pad_token]
        if labels is None:
            return pooled_logits
        return nn.functional.cross_entropy(pooled_logits.view(-1, self.num_labels), labels.view(-1), ignore_index=-100)


# ----------------------------------------------------------------------------------------------------------
# GPT-NeoX (transformers 5.x modeling_gpt_neox.py, eager)


def resolve_neox_config(cfg):
    c = SimpleNamespace()
    c.vocab_size = int(_get(cfg, "vocab_size", 50432))
    c.hidden_size = int(_get(cfg, "hidden_size", 6144))
    c.num_hidden_layers = int(_get(cfg, "num_hidden_layers", 44))
    c.num_attention_heads = int(_get(cfg, "num_attention_heads", 64))
    c.intermediate_size = int(_get(cfg, "intermediate_size", 24576))
    c.hidden_act = _get(cfg, "hidden_act", "gelu")
    c.layer_norm_eps = float(_get(cfg, "layer_norm_eps", 1e-5))
    c.use_parallel_residual = bool(_get(cfg, "use_parallel_residual", True))
    c.attention_bias = bool(_get(cfg, "attention_bias", True))
    c.tie_word_embeddings = bool(_get(cfg, "tie_word_embeddings", False))
    c.attention_dropout = float(_get(cfg, "attention_dropout", 0.0))
    c.hidden_dropout = float(_get(cfg, "hidden_dropout", 0.0))
    if c.hidden_size % c.num_attention_heads:
        raise ValueError("hidden_size must be divisible by num_attention_heads")
    c.head_size = c.hidden_size // c.num_attention_heads
    # 5.x: rope_parameters["partial_rotary_factor"] = kwargs.pop("rotary_pct", 0.25); 4.46-4.57 configs also
    # carry partial_rotary_factor = rotary_pct.
    pct = cfg.get("rotary_pct")
    if pct is None:
        pct = cfg.get("partial_rotary_factor")
    if pct is None:
        pct = _rope_dict(cfg).get("partial_rotary_factor", 0.25)
    c.rotary_ndims = int(c.head_size * float(pct))
    c.rope_theta = _rope_theta(cfg)
    return c


class GPTNeoXAttention(nn.Module):
    def __init__(self, c, layer_idx, device=None):
        super().__init__()
        self.config = c
        self.head_size = c.head_size
        self.attention_dropout = c.attention_dropout
        self.rotary_ndims = c.rotary_ndims
        self.scaling = self.head_size ** -0.5
        self.is_causal = True
        self.layer_idx = layer_idx
        self.query_key_value = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=c.attention_bias, device=device)
        self.dense = nn.Linear(c.hidden_size, c.hidden_size, bias=c.attention_bias, device=device)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, 3 * self.head_size)
        qkv = self.query_key_value(hidden_states).view(hidden_shape).transpose(1, 2)
        query_states, key_states, value_states = qkv.chunk(3, dim=-1)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb_neox(query_states, key_states, cos, sin)
        # (transformers 5.x returns the weights too and the layer binds them to `_`; not modelled for GPT-NeoX yet)
        attn_output = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, dropout=0.0 if not self.training else self.attention_dropout)[0]
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.dense(attn_output)
        return attn_output


class GPTNeoXMLP(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(c.hidden_size, c.intermediate_size, device=device)
        self.dense_4h_to_h = nn.Linear(c.intermediate_size, c.hidden_size, device=device)
        self.act = act_fn(c.hidden_act)

    def forward(self, hidden_states):
        hidden_states = self.dense_h_to_4h(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.dense_4h_to_h(hidden_states)
        return hidden_states


class GPTNeoXLayer(nn.Module):
    def __init__(self, c, layer_idx, device=None):
        super().__init__()
        self.use_parallel_residual = c.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, device=device)
        self.post_attention_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, device=device)
        self.post_attention_dropout = nn.Dropout(c.hidden_dropout)
        self.post_mlp_dropout = nn.Dropout(c.hidden_dropout)
        self.attention = GPTNeoXAttention(c, layer_idx, device)
        self.mlp = GPTNeoXMLP(c, device)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        attn_output = self.attention(self.input_layernorm(hidden_states), attention_mask, position_embeddings)
        attn_output = self.post_attention_dropout(attn_output)
        if self.use_parallel_residual:
            # pseudocode: x = x + attn(ln1(x)) + mlp(ln2(x))
            mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
            mlp_output = self.post_mlp_dropout(mlp_output)
            hidden_states = mlp_output + attn_output + hidden_states
        else:
            # pseudocode: x = x + attn(ln1(x)); x = x + mlp(ln2(x))
            attn_output = attn_output + hidden_states
            mlp_output = self.mlp(self.post_attention_layernorm(attn_output))
            mlp_output = self.post_mlp_dropout(mlp_output)
            hidden_states = mlp_output + attn_output
        return hidden_states


class GPTNeoXModel(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.config = c
        self.embed_in = nn.Embedding(c.vocab_size, c.hidden_size, device=device)
        self.emb_dropout = nn.Dropout(c.hidden_dropout)
        self.layers = nn.ModuleList([GPTNeoXLayer(c, i, device) for i in range(c.num_hidden_layers)])
        self.final_layer_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, device=device)
        self.rotary_emb = RotaryEmbedding(c.rotary_ndims, c.rope_theta, device=device)

    def forward(self, input_ids):
        inputs_embeds = self.embed_in(input_ids)
        B, T = inputs_embeds.shape[:2]
        cache_position = torch.arange(0, T, device=inputs_embeds.device)
        position_ids = cache_position.unsqueeze(0)
        causal_mask = eager_causal_mask(B, T, inputs_embeds.dtype, inputs_embeds.device)
        hidden_states = self.emb_dropout(inputs_embeds)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask, position_embeddings)
        hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class GPTNeoXForCausalLM(nn.Module):
    def __init__(self, cfg, device=None):
        super().__init__()
        c = resolve_neox_config(cfg)
        self.config = c
        self.vocab_size = c.vocab_size
        self.gpt_neox = GPTNeoXModel(c, device)
        self.embed_out = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device=device)
        if c.tie_word_embeddings:
            self.embed_out.weight = self.gpt_neox.embed_in.weight

    def forward(self, input_ids, labels=None):
        hidden_states = self.gpt_neox(input_ids)
        return causal_lm_head(self, self.embed_out, hidden_states, labels)


# ----------------------------------------------------------------------------------------------------------
# Phi (transformers 5.x modeling_phi.py, generated from modular_phi.py; eager)


def resolve_phi_config(cfg):
    """PhiConfig (configuration_phi.py, 5.x) defaults."""
    c = SimpleNamespace()
    c.vocab_size = int(_get(cfg, "vocab_size", 51200))
    c.hidden_size = int(_get(cfg, "hidden_size", 2048))
    c.intermediate_size = int(_get(cfg, "intermediate_size", 8192))
    c.num_hidden_layers = int(_get(cfg, "num_hidden_layers", 24))
    c.num_attention_heads = int(_get(cfg, "num_attention_heads", 32))
    # __post_init__: if self.num_key_value_heads is None: self.num_key_value_heads = self.num_attention_heads
    c.num_key_value_heads = int(_get(cfg, "num_key_value_heads", c.num_attention_heads))
    c.resid_pdrop = float(_get(cfg, "resid_pdrop", 0.0))
    c.embd_pdrop = float(_get(cfg, "embd_pdrop", 0.0))
    c.attention_dropout = float(_get(cfg, "attention_dropout", 0.0))
    c.hidden_act = _get(cfg, "hidden_act", "gelu_new")
    c.layer_norm_eps = float(_get(cfg, "layer_norm_eps", 1e-5))
    c.tie_word_embeddings = bool(_get(cfg, "tie_word_embeddings", False))
    c.qk_layernorm = bool(_get(cfg, "qk_layernorm", False))
    # kwargs.setdefault("partial_rotary_factor", 0.5)
    c.partial_rotary_factor = float(_get(cfg, "partial_rotary_factor", 0.5))
    c.pad_token_id = _get(cfg, "pad_token_id", None)
    c.rope_theta = _rope_theta(cfg)
    # LlamaAttention: head_dim = getattr(config, "head_dim", hidden_size // num_attention_heads)
    c.head_dim = c.hidden_size // c.num_attention_heads
    c.rotary_ndims = int(c.head_dim * c.partial_rotary_factor)
    return c


class PhiAttention(nn.Module):
    def __init__(self, c, layer_idx, device=None):
        super().__init__()
        self.config = c
        self.layer_idx = layer_idx
        self.head_dim = c.head_dim
        self.num_key_value_groups = c.num_attention_heads // c.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = c.attention_dropout
        self.is_causal = True
        H, KV, D, C = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
        self.q_proj = nn.Linear(C, H * D, bias=True, device=device)
        self.k_proj = nn.Linear(C, KV * D, bias=True, device=device)
        self.v_proj = nn.Linear(C, KV * D, bias=True, device=device)
        self.dense = nn.Linear(H * D, C, bias=True, device=device)
        self.rotary_ndims = c.rotary_ndims
        self.qk_layernorm = c.qk_layernorm
        if self.qk_layernorm:
            self.q_layernorm = nn.LayerNorm(C // H, eps=c.layer_norm_eps, elementwise_affine=True, device=device)
            self.k_layernorm = nn.LayerNorm(C // H, eps=c.layer_norm_eps, elementwise_affine=True, device=device)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.qk_layernorm:
            query_states = self.q_layernorm(query_states)
            key_states = self.k_layernorm(key_states)
        cos, sin = position_embeddings
        # Partial rotary embedding
        query_rot, query_pass = (
            query_states[..., : self.rotary_ndims],
            query_states[..., self.rotary_ndims:],
        )
        key_rot, key_pass = (
            key_states[..., : self.rotary_ndims],
            key_states[..., self.rotary_ndims:],
        )
        query_rot, key_rot = apply_rotary_pos_emb(query_rot, key_rot, cos, sin)
        query_states = torch.cat((query_rot, query_pass), dim=-1)
        key_states = torch.cat((key_rot, key_pass), dim=-1)
        key_states, value_states = update_cache(key_states, value_states, self.layer_idx)
        attn_output, attn_weights = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, dropout=0.0 if not self.training else self.attention_dropout)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.dense(attn_output)
        return attn_output, attn_weights


class PhiMLP(nn.Module):
    """CLIPMLP: fc1, activation_fn, fc2."""

    def __init__(self, c, device=None):
        super().__init__()
        self.activation_fn = act_fn(c.hidden_act)
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size, device=device)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size, device=device)

    def forward(self, hidden_states):
        hidden_states = self.fc1(hidden_states)
        hidden_states = self.activation_fn(hidden_states)
        hidden_states = self.fc2(hidden_states)
        return hidden_states


class PhiDecoderLayer(nn.Module):
    def __init__(self, c, layer_idx, device=None):
        super().__init__()
        self.self_attn = PhiAttention(c, layer_idx, device)
        self.mlp = PhiMLP(c, device)
        self.input_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, device=device)
        self.resid_dropout = nn.Dropout(c.resid_pdrop)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        attn_outputs, self_attn_weights = self.self_attn(hidden_states, position_embeddings, attention_mask)
        attn_outputs = self.resid_dropout(attn_outputs)
        feed_forward_hidden_states = self.resid_dropout(self.mlp(hidden_states))
        hidden_states = attn_outputs + feed_forward_hidden_states + residual
        return hidden_states


class PhiModel(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, c.pad_token_id, device=device)
        self.layers = nn.ModuleList([PhiDecoderLayer(c, i, device) for i in range(c.num_hidden_layers)])
        self.rotary_emb = RotaryEmbedding(c.rotary_ndims, c.rope_theta, device=device)
        self.embed_dropout = nn.Dropout(c.embd_pdrop)
        self.final_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, device=device)

    def forward(self, input_ids):
        inputs_embeds = self.embed_tokens(input_ids)
        B, T = inputs_embeds.shape[:2]
        if GENERATION.position_ids is not None:  # passed by generate()
            position_ids = GENERATION.position_ids
        else:
            cache_position = torch.arange(0, T, device=inputs_embeds.device)
            position_ids = cache_position.unsqueeze(0)
        causal_mask = eager_causal_mask(B, T, inputs_embeds.dtype, inputs_embeds.device)
        inputs_embeds = self.embed_dropout(inputs_embeds)  # diff with Llama
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=causal_mask, position_ids=position_ids,
                                  position_embeddings=position_embeddings)
        hidden_states = self.final_layernorm(hidden_states)  # diff with Llama
        return hidden_states


class PhiForCausalLM(nn.Module):
    def __init__(self, cfg, device=None):
        super().__init__()
        c = resolve_phi_config(cfg)
        self.config = c
        self.vocab_size = c.vocab_size
        self.model = PhiModel(c, device)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=True, device=device)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, labels=None):
        hidden_states = self.model(input_ids)
        return causal_lm_head(self, self.lm_head, hidden_states, labels)


# ----------------------------------------------------------------------------------------------------------
# OPT (transformers 5.x modeling_opt.py, eager)


def resolve_opt_config(cfg):
    c = SimpleNamespace()
    c.vocab_size = int(_get(cfg, "vocab_size", 50272))
    c.hidden_size = int(_get(cfg, "hidden_size", 768))
    c.num_hidden_layers = int(_get(cfg, "num_hidden_layers", 12))
    c.ffn_dim = int(_get(cfg, "ffn_dim", 3072))
    c.max_position_embeddings = int(_get(cfg, "max_position_embeddings", 2048))
    c.do_layer_norm_before = bool(_get(cfg, "do_layer_norm_before", True))
    c._remove_final_layer_norm = bool(_get(cfg, "_remove_final_layer_norm", False))
    c.word_embed_proj_dim = int(_get(cfg, "word_embed_proj_dim", c.hidden_size))
    c.dropout = float(_get(cfg, "dropout", 0.1))
    c.attention_dropout = float(_get(cfg, "attention_dropout", 0.0))
    c.num_attention_heads = int(_get(cfg, "num_attention_heads", 12))
    c.activation_function = _get(cfg, "activation_function", "relu")
    c.enable_bias = bool(_get(cfg, "enable_bias", True))
    c.layer_norm_elementwise_affine = bool(_get(cfg, "layer_norm_elementwise_affine", True))
    c.tie_word_embeddings = bool(_get(cfg, "tie_word_embeddings", True))
    pad = cfg.get("pad_token_id", 1)
    c.pad_token_id = pad if isinstance(pad, int) and 0 <= pad < c.vocab_size else None
    if c.hidden_size % c.num_attention_heads:
        raise ValueError("hidden_size must be divisible by num_attention_heads")
    return c


class OPTLearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, device=None):
        self.offset = 2
        super().__init__(num_embeddings + self.offset, embedding_dim, device=device)

    def forward(self, attention_mask, past_key_values_length=0, position_ids=None):
        if position_ids is None:
            position_ids = torch.cumsum(attention_mask, dim=1)
            position_ids = (position_ids * attention_mask - 1).long()
            position_ids = position_ids[:, past_key_values_length:]
        return super().forward(position_ids + self.offset)


class OPTAttention(nn.Module):
    def __init__(self, c, layer_idx, device=None):
        super().__init__()
        self.embed_dim = c.hidden_size
        self.num_heads = c.num_attention_heads
        self.dropout = c.attention_dropout
        self.head_dim = self.embed_dim // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.layer_idx = layer_idx
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=c.enable_bias, device=device)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=c.enable_bias, device=device)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=c.enable_bias, device=device)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=c.enable_bias, device=device)

    def forward(self, hidden_states, attention_mask):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        query_states = query_states.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        key_states = key_states.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        key_states, value_states = update_cache(key_states, value_states, self.layer_idx)
        # (transformers 5.x returns the weights too and the layer binds them; not modelled for OPT yet)
        attn_output = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.dropout, scaling=1.0)[0]
        attn_output = attn_output.reshape(bsz, tgt_len, -1).contiguous()
        attn_output = self.out_proj(attn_output)
        return attn_output


class OPTDecoderLayer(nn.Module):
    def __init__(self, c, layer_idx, device=None):
        super().__init__()
        self.embed_dim = c.hidden_size
        self.self_attn = OPTAttention(c, layer_idx, device)
        self.do_layer_norm_before = c.do_layer_norm_before
        self.dropout = c.dropout
        self.activation_fn = act_fn(c.activation_function)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim, elementwise_affine=c.layer_norm_elementwise_affine,
                                                 device=device)
        self.fc1 = nn.Linear(self.embed_dim, c.ffn_dim, bias=c.enable_bias, device=device)
        self.fc2 = nn.Linear(c.ffn_dim, self.embed_dim, bias=c.enable_bias, device=device)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim, elementwise_affine=c.layer_norm_elementwise_affine,
                                             device=device)

    def forward(self, hidden_states, attention_mask):
        residual = hidden_states
        # 125m, 1.7B, ..., 175B applies layer norm BEFORE attention
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = self.self_attn(hidden_states, attention_mask)
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states
        # 350m applies layer norm AFTER attention
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        # Fully Connected
        hidden_states_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_states.size(-1))
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc1(hidden_states)
        hidden_states = self.activation_fn(hidden_states)
        hidden_states = self.fc2(hidden_states)
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = (residual + hidden_states).view(hidden_states_shape)
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class OPTDecoder(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.word_embed_proj_dim, c.pad_token_id, device=device)
        self.embed_positions = OPTLearnedPositionalEmbedding(c.max_position_embeddings, c.hidden_size, device)
        if c.word_embed_proj_dim != c.hidden_size:
            self.project_out = nn.Linear(c.hidden_size, c.word_embed_proj_dim, bias=False, device=device)
        else:
            self.project_out = None
        if c.word_embed_proj_dim != c.hidden_size:
            self.project_in = nn.Linear(c.word_embed_proj_dim, c.hidden_size, bias=False, device=device)
        else:
            self.project_in = None
        if c.do_layer_norm_before and not c._remove_final_layer_norm:
            self.final_layer_norm = nn.LayerNorm(c.hidden_size, elementwise_affine=c.layer_norm_elementwise_affine,
                                                 device=device)
        else:
            self.final_layer_norm = None
        self.layers = nn.ModuleList([OPTDecoderLayer(c, i, device) for i in range(c.num_hidden_layers)])

    def forward(self, input_ids):
        input_ids = input_ids.view(-1, input_ids.shape[-1])
        inputs_embeds = self.embed_tokens(input_ids)
        past_seen_tokens = 0
        seq_length = past_seen_tokens + inputs_embeds.shape[1]
        if GENERATION.position_ids is not None:
            # generate() passes its attention_mask and position_ids: the decoder makes neither
            attention_mask, position_ids = None, GENERATION.position_ids
        else:
            attention_mask = torch.ones(inputs_embeds.shape[0], seq_length, device=inputs_embeds.device)
            position_ids = torch.cumsum(attention_mask, dim=1)
            position_ids = (position_ids * attention_mask - 1).long()
            position_ids = position_ids[:, past_seen_tokens:]
        # create_causal_mask with an all-ones 2-D padding mask: eager -> float (B,1,T,T)
        causal_mask = eager_causal_mask(inputs_embeds.shape[0], seq_length, inputs_embeds.dtype, inputs_embeds.device)
        pos_embeds = self.embed_positions(attention_mask, past_seen_tokens, position_ids=position_ids)
        if self.project_in is not None:
            inputs_embeds = self.project_in(inputs_embeds)
        hidden_states = inputs_embeds + pos_embeds.to(inputs_embeds.device)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        return hidden_states


class OPTModel(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.decoder = OPTDecoder(c, device)

    def forward(self, input_ids):
        return self.decoder(input_ids)


class OPTForCausalLM(nn.Module):
    def __init__(self, cfg, device=None):
        super().__init__()
        c = resolve_opt_config(cfg)
        self.config = c
        self.vocab_size = c.vocab_size
        self.model = OPTModel(c, device)
        self.lm_head = nn.Linear(c.word_embed_proj_dim, c.vocab_size, bias=False, device=device)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(self, input_ids, labels=None):
        hidden_states = self.model(input_ids)
        kept, labels = keep_logits(self, hidden_states, labels)
        logits = self.lm_head(kept).contiguous()
        if labels is None:
            return logits  # inference (validate/cpu/inference.py): the logits as the model returns them
        return for_causal_lm_loss(logits, labels, vocab_size=self.vocab_size)


# ----------------------------------------------------------------------------------------------------------
# BERT (transformers 5.x modeling_bert.py): BertModel under BertForMaskedLM, BertForSequenceClassification and
# BertForTokenClassification, picked by architectures[0] (trainmem: the config's architectures, or --head).
# The batch is what BertTokenizer and the Trainer's collators make (make_inputs): input_ids, token_type_ids,
# attention_mask (all ones: padded to the longest sequence), labels ((B,) for sequence classification).

BERT_HEADS = {"ForMaskedLM": "masked-lm", "ForSequenceClassification": "seq-cls", "ForTokenClassification": "token-cls"}


def resolve_bert_config(cfg):
    """transformers BertConfig.__init__ defaults (configuration_bert.py) and PreTrainedConfig's num_labels
    (len(id2label) when given, else num_labels, default 2) and tie_word_embeddings (True)."""
    id2label = cfg.get("id2label")
    return SimpleNamespace(
        vocab_size=_get(cfg, ("vocab_size",), 30522),
        hidden_size=_get(cfg, ("hidden_size",), 768),
        num_hidden_layers=_get(cfg, ("num_hidden_layers",), 12),
        num_attention_heads=_get(cfg, ("num_attention_heads",), 12),
        intermediate_size=_get(cfg, ("intermediate_size",), 3072),
        hidden_act=_get(cfg, ("hidden_act",), "gelu"),
        hidden_dropout_prob=_get(cfg, ("hidden_dropout_prob",), 0.1),
        attention_probs_dropout_prob=_get(cfg, ("attention_probs_dropout_prob",), 0.1),
        max_position_embeddings=_get(cfg, ("max_position_embeddings",), 512),
        type_vocab_size=_get(cfg, ("type_vocab_size",), 2),
        layer_norm_eps=_get(cfg, ("layer_norm_eps",), 1e-12),
        pad_token_id=_get(cfg, ("pad_token_id",), 0),
        classifier_dropout=cfg.get("classifier_dropout"),
        num_labels=len(id2label) if id2label else _get(cfg, ("num_labels",), 2),
        tie_word_embeddings=_get(cfg, ("tie_word_embeddings",), True),
    )


class BertEmbeddings(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id, device=device)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size, device=device)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size, device=device)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, device=device)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)
        self.register_buffer("position_ids", torch.arange(c.max_position_embeddings, device=device).expand((1, -1)),
                             persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(self.position_ids.size(), dtype=torch.long, device=device),
                             persistent=False)

    def forward(self, input_ids, token_type_ids=None, past_key_values_length=0):
        position_ids = self.make_position_ids(input_ids, past_key_values_length)
        input_shape = input_ids.size()
        batch_size, seq_length = input_shape
        if token_type_ids is None:
            buffered_token_type_ids = self.token_type_ids.expand(position_ids.shape[0], -1)
            buffered_token_type_ids = torch.gather(buffered_token_type_ids, dim=1, index=position_ids)
            token_type_ids = buffered_token_type_ids.expand(batch_size, seq_length)
        inputs_embeds = self.word_embeddings(input_ids)
        token_type_embeddings = self.token_type_embeddings(token_type_ids)
        embeddings = inputs_embeds + token_type_embeddings
        position_embeddings = self.position_embeddings(position_ids)
        embeddings = embeddings + position_embeddings
        embeddings = self.LayerNorm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings

    def make_position_ids(self, input_ids, past_key_values_length):
        """BertEmbeddings: a view of the position_ids buffer; RobertaEmbeddings computes them from the ids."""
        seq_length = input_ids.shape[1]
        return self.position_ids[:, past_key_values_length: seq_length + past_key_values_length]


def bert_eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0):
    """modeling_bert.py (5.x) eager_attention_forward: softmax without a dtype (no upcast, no cast back)."""
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


class BertSelfAttention(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.num_attention_heads = c.num_attention_heads
        self.attention_head_size = c.hidden_size // c.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.scaling = self.attention_head_size ** -0.5
        self.query = nn.Linear(c.hidden_size, self.all_head_size, device=device)
        self.key = nn.Linear(c.hidden_size, self.all_head_size, device=device)
        self.value = nn.Linear(c.hidden_size, self.all_head_size, device=device)
        self.dropout = nn.Dropout(c.attention_probs_dropout_prob)
        self.is_causal = False

    def forward(self, hidden_states, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)
        query_layer = self.query(hidden_states).view(*hidden_shape).transpose(1, 2)
        key_layer = self.key(hidden_states).view(*hidden_shape).transpose(1, 2)
        value_layer = self.value(hidden_states).view(*hidden_shape).transpose(1, 2)
        attn_output, attn_weights = bert_eager_attention_forward(
            self, query_layer, key_layer, value_layer, attention_mask,
            dropout=0.0 if not self.training else self.dropout.p, scaling=self.scaling)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return attn_output, attn_weights


class _BertDenseResidualNorm(nn.Module):
    """BertSelfOutput and BertOutput, the same code over another input width: dense, dropout,
    LayerNorm(hidden_states + input_tensor). in_features: the config key of dense's input width."""
    in_features = "hidden_size"

    def __init__(self, c, device=None):
        super().__init__()
        self.dense = nn.Linear(getattr(c, self.in_features), c.hidden_size, device=device)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, device=device)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class BertSelfOutput(_BertDenseResidualNorm):
    in_features = "hidden_size"


class BertOutput(_BertDenseResidualNorm):
    in_features = "intermediate_size"


class BertAttention(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.self = BertSelfAttention(c, device)
        self.output = BertSelfOutput(c, device)

    def forward(self, hidden_states, attention_mask=None):
        attention_output, attn_weights = self.self(hidden_states, attention_mask=attention_mask)
        attention_output = self.output(attention_output, hidden_states)
        return attention_output, attn_weights


class BertIntermediate(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size, device=device)
        self.intermediate_act_fn = act_fn(c.hidden_act)

    def forward(self, hidden_states):
        return self.intermediate_act_fn(self.dense(hidden_states))  # dense's output dies once the act returns


class BertLayer(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.attention = BertAttention(c, device)
        self.intermediate = BertIntermediate(c, device)
        self.output = BertOutput(c, device)

    def forward(self, hidden_states, attention_mask=None):
        self_attention_output, _ = self.attention(hidden_states, attention_mask)
        attention_output = self_attention_output
        # apply_chunking_to_forward with chunk_size_feed_forward 0: feed_forward_chunk(attention_output)
        layer_output = self.feed_forward_chunk(attention_output)
        return layer_output

    def feed_forward_chunk(self, attention_output):
        intermediate_output = self.intermediate(attention_output)
        layer_output = self.output(intermediate_output, attention_output)
        return layer_output


class BertEncoder(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(c, device) for _ in range(c.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask=None):
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
        return hidden_states


class BertPooler(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size, device=device)
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        first_token_tensor = hidden_states[:, 0]
        pooled_output = self.dense(first_token_tensor)
        pooled_output = self.activation(pooled_output)
        return pooled_output


def create_bidirectional_mask(inputs_embeds, attention_mask):
    """masking_utils.create_bidirectional_mask (5.x) for eager and sdpa: the 2-D mask .to(torch.bool), and
    sdpa_mask's _ignore_bidirectional_mask_sdpa skips the 4-D mask when padding_mask.all() (no padding)."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask.to(device=inputs_embeds.device, dtype=torch.bool)
    if attention_mask.all():
        return None
    raise NotImplementedError("a padded attention mask is not part of the oracle")


class BertModel(nn.Module):
    def __init__(self, c, add_pooling_layer=True, device=None):
        super().__init__()
        self.embeddings = BertEmbeddings(c, device)
        self.encoder = BertEncoder(c, device)
        self.pooler = BertPooler(c, device) if add_pooling_layer else None

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        seq_length = input_ids.shape[1]
        cache_position = torch.arange(0, seq_length, device=input_ids.device)  # noqa: F841 (bound until return)
        embedding_output = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        attention_mask = create_bidirectional_mask(embedding_output, attention_mask)
        sequence_output = self.encoder(embedding_output, attention_mask=attention_mask)
        pooled_output = self.pooler(sequence_output) if self.pooler is not None else None
        return sequence_output, pooled_output


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.transform_act_fn = act_fn(c.hidden_act)  # no parameters: its place among the modules changes nothing
        self.dense = nn.Linear(c.hidden_size, c.hidden_size, device=device)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, device=device)

    def forward(self, hidden_states):
        # dense, act, LayerNorm: each rebinding of hidden_states frees the previous one once the next op returns
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden_states)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.transform = BertPredictionHeadTransform(c, device)
        self.decoder = nn.Linear(c.hidden_size, c.vocab_size, bias=True, device=device)
        self.bias = nn.Parameter(torch.zeros(c.vocab_size, device=device))
        self.decoder.bias = self.bias  # _tied_weights_keys: cls.predictions.decoder.bias -> cls.predictions.bias

    def forward(self, hidden_states):
        return self.decoder(self.transform(hidden_states))  # the transform's output dies once decoder returns


class BertOnlyMLMHead(nn.Module):
    """Its forward returns self.predictions(sequence_output): BertForMaskedLM.mlm_head calls that directly."""

    def __init__(self, c, device=None):
        super().__init__()
        self.predictions = BertLMPredictionHead(c, device)


def classification_output(logits, labels, num_labels):
    """The logits without labels; with them CrossEntropyLoss()(logits.view(-1, num_labels), labels.view(-1)): the
    token-classification loss and single_label_classification (problem_type None, num_labels > 1, int64 labels)."""
    if labels is None:
        return logits
    loss_fct = nn.CrossEntropyLoss()
    return loss_fct(logits.view(-1, num_labels), labels.view(-1))


class _BertTask(nn.Module):
    """What the Bert*For* classes share here: the batch the tokenizer and collator make, and the base model
    (the attribute named base_model_prefix, as PreTrainedModel.base_model)."""
    base_model_prefix = "bert"

    @property
    def base_model(self):
        return getattr(self, self.base_model_prefix)

    def make_inputs(self, batch, seq, generator, labels=True):
        ids = torch.randint(0, self.vocab_size, (batch, seq), dtype=torch.int64, generator=generator)
        token_type_ids = torch.zeros(batch, seq, dtype=torch.int64)
        attention_mask = torch.ones(batch, seq, dtype=torch.int64)
        inputs = [ids, token_type_ids, attention_mask]
        if labels:
            inputs.append(self.make_labels(batch, seq, generator))
        return inputs


class BertForMaskedLM(_BertTask):
    def __init__(self, c, device=None):
        super().__init__()
        if not c.tie_word_embeddings:
            raise ValueError("an untied MLM decoder is not part of the oracle")
        self.vocab_size = c.vocab_size
        self.build(c, device)

    def build(self, c, device):
        self.bert = BertModel(c, add_pooling_layer=False, device=device)
        self.cls = BertOnlyMLMHead(c, device)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def mlm_head(self, sequence_output):
        return self.cls.predictions(sequence_output)  # BertOnlyMLMHead.forward

    def make_labels(self, batch, seq, g):
        # DataCollatorForLanguageModeling: (B, T) int64, -100 where a token is not masked
        labels = torch.randint(0, self.vocab_size, (batch, seq), dtype=torch.int64, generator=g)
        labels[:, ::2] = -100
        return labels

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None):
        outputs = self.base_model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        sequence_output = outputs[0]
        prediction_scores = self.mlm_head(sequence_output)
        return classification_output(prediction_scores, labels, self.vocab_size)  # -100 index = padding token


class BertForTokenClassification(_BertTask):
    """BertForTokenClassification: dropout and classifier over last_hidden_state (outputs[0]), BertModel without
    the pooler. BertForSequenceClassification is the same code over pooler_output (outputs[1])."""
    pooled = False

    def __init__(self, c, device=None):
        super().__init__()
        self.num_labels = c.num_labels
        self.vocab_size = c.vocab_size
        setattr(self, self.base_model_prefix, self.model_class(c, add_pooling_layer=self.pooled, device=device))
        classifier_dropout = c.classifier_dropout if c.classifier_dropout is not None else c.hidden_dropout_prob
        self.dropout = nn.Dropout(classifier_dropout)
        self.classifier = nn.Linear(c.hidden_size, c.num_labels, device=device)

    @property
    def model_class(self):
        return BertModel

    def make_labels(self, batch, seq, g):
        # DataCollatorForTokenClassification: (B, T) int64
        return torch.randint(0, self.num_labels, (batch, seq), dtype=torch.int64, generator=g)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None):
        outputs = self.base_model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        features = outputs[1 if self.pooled else 0]  # pooled_output / sequence_output
        features = self.dropout(features)
        logits = self.classifier(features)
        return classification_output(logits, labels, self.num_labels)


class BertForSequenceClassification(BertForTokenClassification):
    pooled = True  # BertModel(config) keeps its pooler

    def make_labels(self, batch, seq, g):
        return torch.randint(0, self.num_labels, (batch,), dtype=torch.int64, generator=g)  # DataCollatorWithPadding


def build_bert(cfg, device=None):
    """The Bert*For* class of architectures[0] (trainmem's head); BertForMaskedLM without one."""
    c = resolve_bert_config(cfg)
    arch = (cfg.get("architectures") or ["BertForMaskedLM"])[0]
    for suffix, cls in (("ForMaskedLM", BertForMaskedLM), ("ForSequenceClassification", BertForSequenceClassification),
                        ("ForTokenClassification", BertForTokenClassification)):
        if arch.endswith(suffix):
            return cls(c, device)
    raise ValueError(f"unsupported BERT head {arch!r}")


# ----------------------------------------------------------------------------------------------------------
# RoBERTa (transformers 5.x modular_roberta.py -> modeling_roberta.py): BertModel's layers under RobertaEmbeddings
# (position ids from padding_idx + 1), RobertaLMHead and RobertaClassificationHead, all under "roberta." and
# add_pooling_layer=False for every head here. RobertaTokenizer.model_input_names = ["input_ids",
# "attention_mask"]: the batch has no token_type_ids (make_inputs), so the embeddings gather their zeros buffer.


def resolve_roberta_config(cfg):
    """RobertaConfig.__init__: BertConfig's defaults but vocab_size=50265 and pad_token_id=1."""
    return resolve_bert_config({"vocab_size": 50265, "pad_token_id": 1, **cfg})


class RobertaEmbeddings(BertEmbeddings):
    def __init__(self, c, device=None):
        super().__init__(c, device)
        del self.position_embeddings
        self.padding_idx = c.pad_token_id
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size, padding_idx=self.padding_idx,
                                                device=device)

    def make_position_ids(self, input_ids, past_key_values_length):
        # RobertaEmbeddings.forward: position_ids = self.create_position_ids_from_input_ids(input_ids,
        # self.padding_idx, past_key_values_length); the rest of its forward is BertEmbeddings'
        return self.create_position_ids_from_input_ids(input_ids, self.padding_idx, past_key_values_length)

    @staticmethod
    def create_position_ids_from_input_ids(input_ids, padding_idx, past_key_values_length=0):
        mask = input_ids.ne(padding_idx).int()
        incremental_indices = (torch.cumsum(mask, dim=1).type_as(mask) + past_key_values_length) * mask
        return incremental_indices.long() + padding_idx


class RobertaModel(BertModel):
    def __init__(self, c, add_pooling_layer=True, device=None):
        super().__init__(c, add_pooling_layer=add_pooling_layer, device=device)
        self.embeddings = RobertaEmbeddings(c, device)  # the same slot in _modules: registration order kept


class RobertaLMHead(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size, device=device)
        self.layer_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, device=device)
        self.decoder = nn.Linear(c.hidden_size, c.vocab_size, device=device)
        self.bias = nn.Parameter(torch.zeros(c.vocab_size, device=device))
        self.decoder.bias = self.bias  # _tied_weights_keys: lm_head.decoder.bias -> lm_head.bias

    def forward(self, features):
        # x = self.dense(features); x = gelu(x) (activations.gelu: GELUActivation, erf, whatever hidden_act
        # says); x = self.layer_norm(x); x = self.decoder(x): each rebinding frees the previous x, as here
        x = nn.functional.gelu(self.dense(features))
        x = self.layer_norm(x)
        return self.decoder(x)


class RobertaClassificationHead(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size, device=device)
        classifier_dropout = c.classifier_dropout if c.classifier_dropout is not None else c.hidden_dropout_prob
        self.dropout = nn.Dropout(classifier_dropout)
        self.out_proj = nn.Linear(c.hidden_size, c.num_labels, device=device)

    def forward(self, features):
        x = features[:, 0, :]  # take <s> token (equiv. to [CLS])
        x = self.dropout(x)
        x = self.dense(x)
        x = torch.tanh(x)
        x = self.dropout(x)
        x = self.out_proj(x)
        return x


class _RobertaTask(_BertTask):
    """The RobertaFor* classes here: the Bert*For* code under "roberta." with RoBERTa's batch (input_ids,
    attention_mask, labels: RobertaTokenizer has no token_type_ids) and forward(input_ids, attention_mask, labels)."""
    base_model_prefix = "roberta"

    @property
    def model_class(self):
        return RobertaModel

    def make_inputs(self, batch, seq, generator, labels=True):
        ids = torch.randint(0, self.vocab_size, (batch, seq), dtype=torch.int64, generator=generator)
        attention_mask = torch.ones(batch, seq, dtype=torch.int64)
        inputs = [ids, attention_mask]
        if labels:
            inputs.append(self.make_labels(batch, seq, generator))
        return inputs

    def forward(self, input_ids, attention_mask=None, labels=None):
        return super().forward(input_ids, None, attention_mask, labels)


class RobertaForMaskedLM(_RobertaTask, BertForMaskedLM):
    def build(self, c, device):
        self.roberta = RobertaModel(c, add_pooling_layer=False, device=device)
        self.lm_head = RobertaLMHead(c, device)
        self.lm_head.decoder.weight = self.roberta.embeddings.word_embeddings.weight

    def mlm_head(self, sequence_output):
        return self.lm_head(sequence_output)


class RobertaForSequenceClassification(_RobertaTask, BertForSequenceClassification):
    def __init__(self, c, device=None):
        _BertTask.__init__(self)
        self.num_labels = c.num_labels
        self.vocab_size = c.vocab_size
        self.roberta = RobertaModel(c, add_pooling_layer=False, device=device)
        self.classifier = RobertaClassificationHead(c, device)

    def forward(self, input_ids, attention_mask=None, labels=None):
        outputs = self.roberta(input_ids, attention_mask=attention_mask)
        sequence_output = outputs[0]
        logits = self.classifier(sequence_output)
        return classification_output(logits, labels, self.num_labels)


class RobertaForTokenClassification(_RobertaTask, BertForTokenClassification):
    pass


def build_roberta(cfg, device=None):
    """The RobertaFor* class of architectures[0]; RobertaForMaskedLM without one."""
    c = resolve_roberta_config(cfg)
    arch = (cfg.get("architectures") or ["RobertaForMaskedLM"])[0]
    for suffix, cls in (("ForMaskedLM", RobertaForMaskedLM),
                        ("ForSequenceClassification", RobertaForSequenceClassification),
                        ("ForTokenClassification", RobertaForTokenClassification)):
        if arch.endswith(suffix):
            return cls(c, device)
    raise ValueError(f"unsupported RoBERTa head {arch!r}")
# Falcon (transformers 5.x modeling_falcon.py, read at zucchini-nlp/transformers@e241202, a fork of main; eager
# and the layouts new_decoder_architecture / multi_query / per-head, rotary or ALiBi). use_cache=False.


def resolve_falcon_config(cfg):
    """FalconConfig (configuration_falcon.py, 5.x @strict dataclass) defaults and __post_init__."""
    c = SimpleNamespace()
    c.vocab_size = int(_get(cfg, "vocab_size", 65024))
    # __post_init__: n_embed = kwargs.pop("n_embed", None); hidden_size = hidden_size if n_embed is None else n_embed
    c.hidden_size = int(_get(cfg, ("n_embed", "hidden_size"), 4544))
    c.num_hidden_layers = int(_get(cfg, "num_hidden_layers", 32))
    c.num_attention_heads = int(_get(cfg, "num_attention_heads", 71))
    c.num_ln_in_parallel_attn = _get(cfg, "num_ln_in_parallel_attn", None)
    c.layer_norm_epsilon = float(_get(cfg, "layer_norm_epsilon", 1e-5))
    c.hidden_dropout = float(_get(cfg, "hidden_dropout", 0.0))
    c.attention_dropout = float(_get(cfg, "attention_dropout", 0.0))
    c.num_kv_heads = _get(cfg, "num_kv_heads", None)
    c.alibi = bool(_get(cfg, "alibi", False))
    c.new_decoder_architecture = bool(_get(cfg, "new_decoder_architecture", False))
    c.multi_query = bool(_get(cfg, "multi_query", True))
    c.parallel_attn = bool(_get(cfg, "parallel_attn", True))
    c.bias = bool(_get(cfg, "bias", False))
    c.ffn_hidden_size = _get(cfg, "ffn_hidden_size", None)
    c.activation = _get(cfg, "activation", "gelu")
    c.tie_word_embeddings = bool(_get(cfg, "tie_word_embeddings", True))
    c.rope_theta = _rope_theta(cfg)
    # __post_init__: num_kv_heads None -> num_attention_heads; ffn_hidden_size None -> hidden_size * 4
    if c.num_kv_heads is None:
        c.num_kv_heads = c.num_attention_heads
    c.num_kv_heads = int(c.num_kv_heads)
    if c.ffn_hidden_size is None:
        c.ffn_hidden_size = c.hidden_size * 4
    c.ffn_hidden_size = int(c.ffn_hidden_size)
    c.head_dim = c.hidden_size // c.num_attention_heads
    return c


class FalconLinear(nn.Linear):
    def forward(self, input):
        hidden_states = input @ self.weight.T
        if self.bias is None:
            return hidden_states
        return hidden_states + self.bias


def build_alibi_tensor(attention_mask, num_heads, dtype):
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(
        2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), device=attention_mask.device, dtype=torch.float32
    )
    powers = torch.arange(1, 1 + closest_power_of_2, device=attention_mask.device, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    if closest_power_of_2 != num_heads:
        extra_base = torch.tensor(
            2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))), device=attention_mask.device, dtype=torch.float32
        )
        num_remaining_heads = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(1, 1 + 2 * num_remaining_heads, 2, device=attention_mask.device, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)], dim=0)
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None].bfloat16() * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


def dropout_add(x, residual, prob, training):
    out = F.dropout(x, p=prob, training=training)
    out = residual + out
    return out


class FalconAttention(nn.Module):
    """FalconAttention, its eager paths: rotary (scores /= sqrt(head_dim), no dropout) and ALiBi (scores upcast to
    float32, + alibi, *= inv_norm_factor, dropout). The layer_past update sits where update_cache is called."""

    def __init__(self, c, layer_idx, device=None):
        super().__init__()
        self.config = c
        self.hidden_size = c.hidden_size
        self.num_heads = c.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.layer_idx = layer_idx
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        if c.new_decoder_architecture:
            qkv_out_dim = (c.num_kv_heads * 2 + c.num_attention_heads) * self.head_dim
        elif c.multi_query:
            qkv_out_dim = self.hidden_size + 2 * self.head_dim
        else:
            qkv_out_dim = 3 * self.hidden_size
        self.query_key_value = FalconLinear(self.hidden_size, qkv_out_dim, bias=c.bias, device=device)
        self.new_decoder_architecture = c.new_decoder_architecture
        self.multi_query = c.multi_query
        self.dense = FalconLinear(self.hidden_size, self.hidden_size, bias=c.bias, device=device)
        self.attention_dropout = nn.Dropout(c.attention_dropout)
        self.num_kv_heads = c.num_kv_heads if (self.new_decoder_architecture or not self.multi_query) else 1

    def _split_heads(self, fused_qkv):
        if self.new_decoder_architecture:
            batch, seq_len, _ = fused_qkv.shape
            qkv = fused_qkv.view(batch, seq_len, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
            query = qkv[:, :, :, :-2]
            key = qkv[:, :, :, [-2]]
            value = qkv[:, :, :, [-1]]
            key = torch.broadcast_to(key, query.shape)
            value = torch.broadcast_to(value, query.shape)
            query, key, value = [x.flatten(2, 3) for x in (query, key, value)]
            return query, key, value
        elif not self.multi_query:
            batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
            fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads, 3, self.head_dim)
            return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]
        else:
            batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
            fused_qkv = fused_qkv.view(batch_size, seq_length, self.num_heads + 2, self.head_dim)
            return fused_qkv[..., :-2, :], fused_qkv[..., [-2], :], fused_qkv[..., [-1], :]

    def _merge_heads(self, x):
        batch_size_and_num_heads, seq_length, _ = x.shape
        batch_size = batch_size_and_num_heads // self.num_heads
        x = x.view(batch_size, self.num_heads, seq_length, self.head_dim)
        x = x.permute(0, 2, 1, 3)
        return x.reshape(batch_size, seq_length, self.num_heads * self.head_dim)

    def forward(self, hidden_states, alibi, attention_mask, position_embeddings=None):
        fused_qkv = self.query_key_value(hidden_states)  # [batch_size, seq_length, 3 x hidden_size]
        num_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
        (query_layer, key_layer, value_layer) = self._split_heads(fused_qkv)
        batch_size, query_length, _, _ = query_layer.shape
        query_layer = query_layer.transpose(1, 2).reshape(batch_size, self.num_heads, query_length, self.head_dim)
        key_layer = key_layer.transpose(1, 2).reshape(batch_size, num_kv_heads, query_length, self.head_dim)
        value_layer = value_layer.transpose(1, 2).reshape(batch_size, num_kv_heads, query_length, self.head_dim)
        if alibi is None:
            cos, sin = position_embeddings
            query_layer, key_layer = apply_rotary_pos_emb(query_layer, key_layer, cos, sin)
        key_layer, value_layer = update_cache(key_layer, value_layer, self.layer_idx)
        kv_length = key_layer.shape[-2]
        if attention_mask is not None:
            attention_mask = attention_mask[:, :, :, : key_layer.shape[-2]]
        if alibi is None:
            # (eager; torch 1.13 has no SDPA)
            attention_scores = query_layer @ key_layer.transpose(-1, -2)
            attention_scores /= math.sqrt(self.head_dim)
            attention_scores = F.softmax(attention_scores + attention_mask, dim=-1, dtype=hidden_states.dtype)
            # It is unclear why dropout is not applied here (while it is with alibi).
            attn_output = attention_scores @ value_layer
            attn_output = attn_output.view(batch_size, self.num_heads, query_length, self.head_dim)
            attn_output = attn_output.permute(0, 2, 1, 3)
            attn_output = attn_output.reshape(batch_size, query_length, self.num_heads * self.head_dim)
            attn_output = self.dense(attn_output)
            return attn_output, attention_scores
        matmul_result = query_layer @ key_layer.transpose(-1, -2)
        attention_scores = matmul_result.view(batch_size, self.num_heads, query_length, kv_length)
        input_dtype = attention_scores.dtype
        if input_dtype == torch.float16 or input_dtype == torch.bfloat16:
            attention_scores = attention_scores.to(torch.float32)
        attention_logits = attention_scores + alibi.view(batch_size, self.num_heads, 1, -1)
        attention_logits *= self.inv_norm_factor
        attention_probs = F.softmax(attention_logits + attention_mask, dim=-1, dtype=hidden_states.dtype)
        attention_probs = self.attention_dropout(attention_probs)
        attention_probs_reshaped = attention_probs.view(batch_size, self.num_heads, query_length, kv_length)
        attn_output = (attention_probs_reshaped @ value_layer).flatten(0, 1)
        attn_output = self._merge_heads(attn_output)
        attn_output = self.dense(attn_output)
        return attn_output, attention_probs


class FalconMLP(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        hidden_size = c.hidden_size
        self.dense_h_to_4h = FalconLinear(hidden_size, c.ffn_hidden_size, bias=c.bias, device=device)
        self.act = act_fn(c.activation)
        self.dense_4h_to_h = FalconLinear(c.ffn_hidden_size, hidden_size, bias=c.bias, device=device)
        self.hidden_dropout = c.hidden_dropout

    def forward(self, x):
        x = self.act(self.dense_h_to_4h(x))
        x = self.dense_4h_to_h(x)
        return x


class FalconDecoderLayer(nn.Module):
    """self_attention and mlp first, then the layout's layer norms: post_attention_layernorm + input_layernorm
    (sequential), ln_attn + ln_mlp (num_ln_in_parallel_attn 2) or one input_layernorm. Returns (output, weights)."""

    def __init__(self, c, layer_idx, device=None):
        super().__init__()
        hidden_size = c.hidden_size
        self.num_heads = c.num_attention_heads
        self.self_attention = FalconAttention(c, layer_idx, device)
        self.mlp = FalconMLP(c, device)
        self.hidden_dropout = c.hidden_dropout
        self.config = c
        if c.num_ln_in_parallel_attn is None and c.new_decoder_architecture:
            c.num_ln_in_parallel_attn = 2
        if not c.parallel_attn:
            self.post_attention_layernorm = nn.LayerNorm(hidden_size, eps=c.layer_norm_epsilon, device=device)
            self.input_layernorm = nn.LayerNorm(hidden_size, eps=c.layer_norm_epsilon, device=device)
        else:
            if c.num_ln_in_parallel_attn == 2:
                self.ln_attn = nn.LayerNorm(hidden_size, eps=c.layer_norm_epsilon, device=device)
                self.ln_mlp = nn.LayerNorm(hidden_size, eps=c.layer_norm_epsilon, device=device)
            else:
                self.input_layernorm = nn.LayerNorm(hidden_size, eps=c.layer_norm_epsilon, device=device)

    def forward(self, hidden_states, alibi, attention_mask, position_embeddings=None):
        residual = hidden_states
        if self.config.new_decoder_architecture and self.config.num_ln_in_parallel_attn == 2:
            attention_layernorm_out = self.ln_attn(hidden_states)
            mlp_layernorm_out = self.ln_mlp(hidden_states)
        else:
            attention_layernorm_out = self.input_layernorm(hidden_states)
        attention_output, attn_weights = self.self_attention(
            attention_layernorm_out, alibi=alibi, attention_mask=attention_mask,
            position_embeddings=position_embeddings)
        if not self.config.new_decoder_architecture:
            if self.config.parallel_attn:
                mlp_layernorm_out = attention_layernorm_out
            else:
                residual = dropout_add(attention_output, residual, self.config.attention_dropout,
                                       training=self.training)
                mlp_layernorm_out = self.post_attention_layernorm(residual)
        if (self.config.new_decoder_architecture and self.config.parallel_attn
                and self.config.num_ln_in_parallel_attn == 1):
            mlp_layernorm_out = attention_layernorm_out
        mlp_output = self.mlp(mlp_layernorm_out)
        if self.config.new_decoder_architecture or self.config.parallel_attn:
            mlp_output += attention_output
        output = dropout_add(mlp_output, residual, self.config.hidden_dropout, training=self.training)
        return output, attn_weights


class FalconModel(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.config = c
        self.embed_dim = c.hidden_size
        self.num_heads = c.num_attention_heads
        self.use_alibi = c.alibi
        self.word_embeddings = nn.Embedding(c.vocab_size, self.embed_dim, device=device)
        self.h = nn.ModuleList([FalconDecoderLayer(c, i, device) for i in range(c.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=c.layer_norm_epsilon, device=device)
        self.rotary_emb = RotaryEmbedding(c.head_dim, c.rope_theta, device=device)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position, past_seen_tokens, alibi):
        """Eager (torch 1.13 has no SDPA), no static cache; attention_mask: generate()'s 2-D one, or None."""
        dtype, device = input_tensor.dtype, input_tensor.device
        min_dtype = torch.finfo(dtype).min
        batch_size, sequence_length, _ = input_tensor.shape
        target_length = (
            attention_mask.shape[-1] if isinstance(attention_mask, torch.Tensor) else past_seen_tokens + sequence_length
        )
        causal_mask = self._prepare_4d_causal_attention_mask_with_cache_position(
            attention_mask, sequence_length=sequence_length, target_length=target_length, dtype=dtype,
            cache_position=cache_position, batch_size=input_tensor.shape[0])
        if alibi is not None:
            alibi = alibi.reshape(batch_size, -1, *alibi.shape[1:])
            causal_mask = torch.masked_fill(
                alibi / math.sqrt(self.config.hidden_size // self.num_heads),
                causal_mask < -1,
                min_dtype,
            )
        return causal_mask

    @staticmethod
    def _prepare_4d_causal_attention_mask_with_cache_position(attention_mask, sequence_length, target_length, dtype,
                                                              cache_position, batch_size, **kwargs):
        min_dtype = torch.finfo(dtype).min
        causal_mask = torch.full(
            (sequence_length, target_length), fill_value=min_dtype, dtype=dtype, device=cache_position.device
        )
        if sequence_length != 1:
            causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask *= torch.arange(target_length, device=cache_position.device) > cache_position.reshape(-1, 1)
        causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1)
        if attention_mask is not None:
            causal_mask = causal_mask.clone()  # copy to contiguous memory for in-place edit
            mask_length = attention_mask.shape[-1]
            padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :].to(
                causal_mask.device
            )
            padding_mask = padding_mask == 0
            causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(
                padding_mask, min_dtype
            )
        return causal_mask

    def forward(self, input_ids):
        inputs_embeds = self.word_embeddings(input_ids)
        # generate() passes its attention_mask and position_ids (models.GENERATION); training passes neither
        attention_mask, position_ids = GENERATION.attention_mask, GENERATION.position_ids
        alibi = None
        past_key_values = GENERATION.cache
        past_key_values_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        batch_size, seq_length, _ = inputs_embeds.shape
        if self.use_alibi:
            mask = (
                torch.ones(
                    (batch_size, seq_length + past_key_values_length), device=inputs_embeds.device, dtype=torch.long
                )
                if attention_mask is None
                else attention_mask
            )
            alibi = build_alibi_tensor(mask, self.num_heads, dtype=inputs_embeds.dtype)
        cache_position = torch.arange(
            past_key_values_length, past_key_values_length + seq_length, device=inputs_embeds.device
        )
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position, past_key_values_length,
                                               alibi)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for i, block in enumerate(self.h):
            outputs = block(hidden_states, alibi=alibi, attention_mask=causal_mask,
                            position_embeddings=position_embeddings)
            hidden_states = outputs[0]
        hidden_states = self.ln_f(hidden_states)
        return hidden_states


class FalconForCausalLM(nn.Module):
    """lm_head = nn.Linear(hidden_size, vocab_size, bias=False); _tied_weights_keys = {"lm_head.weight":
    "transformer.word_embeddings.weight"}, applied when tie_word_embeddings (the default)."""

    def __init__(self, cfg, device=None):
        super().__init__()
        self.config = resolve_falcon_config(cfg)
        self.vocab_size = self.config.vocab_size
        self.transformer = FalconModel(self.config, device)
        self.lm_head = nn.Linear(self.config.hidden_size, self.vocab_size, bias=False, device=device)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.word_embeddings.weight

    def forward(self, input_ids, labels=None):
        hidden_states = self.transformer(input_ids)
        return causal_lm_head(self, self.lm_head, hidden_states, labels)


# ----------------------------------------------------------------------------------------------------------
# "mlp" layer stack (trainmem impl "stack")


class MLPStack(nn.Module):
    is_stack = True

    def __init__(self, cfg, device=None):
        super().__init__()
        self.input_features = int(cfg["input"])
        width = self.input_features
        layers = []
        for spec in cfg["layers"]:
            if isinstance(spec, dict) and "linear" in spec:
                out = int(spec["linear"])
                layers.append(nn.Linear(width, out, bias=bool(spec.get("bias", True)), device=device))
                width = out
            elif spec == "relu":
                layers.append(nn.ReLU())
            elif spec == "gelu":
                layers.append(nn.GELU())
            elif spec == "sigmoid":
                layers.append(nn.Sigmoid())
            elif spec == "layer_norm":
                layers.append(nn.LayerNorm(width, device=device))
            else:
                raise ValueError(f"unsupported mlp layer {spec!r}")
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        # seed 003's script: `y = model(x); y.sum().backward()`: y stays bound (here: kept_output) until the next
        # forward, through backward and the optimizer step (trainmem --loop plain keeps it the same way)
        self.kept_output = self.net(x)
        return self.kept_output.sum()


# ----------------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------------
# T5 (transformers modeling_t5.py: T5ForConditionalGeneration, labels given, use_cache=False, eager: T5Attention
# has one code path). The stacks' masks and _shift_right as written at huggingface/transformers@6b8b757; the
# attention ops are the same in 5.x.


def resolve_t5_config(cfg):
    """T5Config (configuration_t5.py) defaults; attribute_map hidden_size->d_model, num_attention_heads->num_heads,
    num_hidden_layers->num_layers."""
    c = SimpleNamespace()
    c.vocab_size = int(_get(cfg, "vocab_size", 32128))
    c.d_model = int(_get(cfg, ("d_model", "hidden_size"), 512))
    c.d_kv = int(_get(cfg, "d_kv", 64))
    c.d_ff = int(_get(cfg, "d_ff", 2048))
    c.num_layers = int(_get(cfg, ("num_layers", "num_hidden_layers"), 6))
    ndl = cfg.get("num_decoder_layers")
    c.num_decoder_layers = int(ndl) if ndl is not None else c.num_layers  # "default = symmetry"
    c.num_heads = int(_get(cfg, ("num_heads", "num_attention_heads"), 8))
    c.relative_attention_num_buckets = int(_get(cfg, "relative_attention_num_buckets", 32))
    c.relative_attention_max_distance = int(_get(cfg, "relative_attention_max_distance", 128))
    c.dropout_rate = float(_get(cfg, "dropout_rate", 0.1))
    c.layer_norm_epsilon = float(_get(cfg, "layer_norm_epsilon", 1e-6))
    c.feed_forward_proj = _get(cfg, "feed_forward_proj", "relu")
    act_info = c.feed_forward_proj.split("-")
    c.dense_act_fn = act_info[-1]
    c.is_gated_act = act_info[0] == "gated"
    if len(act_info) > 1 and act_info[0] != "gated" or len(act_info) > 2:
        raise ValueError(f"`feed_forward_proj`: {c.feed_forward_proj} is not a valid activation function of the "
                         "dense layer")
    if c.feed_forward_proj == "gated-gelu":  # "for backwards compatibility"
        c.dense_act_fn = "gelu_new"
    # PretrainedConfig.__init__ sets the remaining kwargs last: a saved dense_act_fn / is_gated_act wins
    c.dense_act_fn = cfg.get("dense_act_fn", c.dense_act_fn)
    c.is_gated_act = bool(cfg.get("is_gated_act", c.is_gated_act))
    c.tie_word_embeddings = bool(_get(cfg, "tie_word_embeddings", True))
    c.decoder_start_token_id = int(_get(cfg, "decoder_start_token_id", 0))
    c.pad_token_id = int(_get(cfg, "pad_token_id", 0))
    return c


class T5LayerNorm(LlamaRMSNorm):
    """The same parameter (a weight of ones) and epsilon as LlamaRMSNorm; its own forward: the rsqrt multiplies the
    input itself, and the cast to 16 bits depends on the weight's dtype."""

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


def _t5_wo(wo, hidden_states):
    """T5DenseActDense / T5DenseGatedActDense after the dropout: `if isinstance(self.wo.weight, torch.Tensor) and
    hidden_states.dtype != self.wo.weight.dtype and self.wo.weight.dtype != torch.int8: hidden_states =
    hidden_states.to(self.wo.weight.dtype)`; then self.wo(hidden_states)."""
    if isinstance(wo.weight, torch.Tensor) and hidden_states.dtype != wo.weight.dtype and wo.weight.dtype != torch.int8:
        hidden_states = hidden_states.to(wo.weight.dtype)
    return wo(hidden_states)


class T5DenseActDense(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.wi = nn.Linear(c.d_model, c.d_ff, bias=False, device=device)
        self.wo = nn.Linear(c.d_ff, c.d_model, bias=False, device=device)
        self.dropout = nn.Dropout(c.dropout_rate)
        self.act = act_fn(c.dense_act_fn)

    def forward(self, hidden_states):
        hidden_states = self.wi(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return _t5_wo(self.wo, hidden_states)


class T5DenseGatedActDense(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.wi_0 = nn.Linear(c.d_model, c.d_ff, bias=False, device=device)
        self.wi_1 = nn.Linear(c.d_model, c.d_ff, bias=False, device=device)
        self.wo = nn.Linear(c.d_ff, c.d_model, bias=False, device=device)
        self.dropout = nn.Dropout(c.dropout_rate)
        self.act = act_fn(c.dense_act_fn)

    def forward(self, hidden_states):
        hidden_gelu = self.act(self.wi_0(hidden_states))
        hidden_linear = self.wi_1(hidden_states)
        hidden_states = hidden_gelu * hidden_linear
        hidden_states = self.dropout(hidden_states)
        return _t5_wo(self.wo, hidden_states)


class T5LayerFF(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.DenseReluDense = T5DenseGatedActDense(c, device) if c.is_gated_act else T5DenseActDense(c, device)
        self.layer_norm = T5LayerNorm(c.d_model, eps=c.layer_norm_epsilon, device=device)
        self.dropout = nn.Dropout(c.dropout_rate)

    def forward(self, hidden_states):
        forwarded_states = self.layer_norm(hidden_states)
        forwarded_states = self.DenseReluDense(forwarded_states)
        hidden_states = hidden_states + self.dropout(forwarded_states)
        return hidden_states


class T5Attention(nn.Module):
    def __init__(self, c, is_decoder, has_relative_attention_bias=False, device=None):
        super().__init__()
        self.is_decoder = is_decoder
        self.has_relative_attention_bias = has_relative_attention_bias
        self.relative_attention_num_buckets = c.relative_attention_num_buckets
        self.relative_attention_max_distance = c.relative_attention_max_distance
        self.d_model = c.d_model
        self.key_value_proj_dim = c.d_kv
        self.n_heads = c.num_heads
        self.dropout = c.dropout_rate
        self.inner_dim = self.n_heads * self.key_value_proj_dim
        self.q = nn.Linear(self.d_model, self.inner_dim, bias=False, device=device)
        self.k = nn.Linear(self.d_model, self.inner_dim, bias=False, device=device)
        self.v = nn.Linear(self.d_model, self.inner_dim, bias=False, device=device)
        self.o = nn.Linear(self.inner_dim, self.d_model, bias=False, device=device)
        if self.has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.relative_attention_num_buckets, self.n_heads,
                                                        device=device)

    @staticmethod
    def _relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
        relative_buckets = 0
        if bidirectional:
            num_buckets //= 2
            relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
            relative_position = torch.abs(relative_position)
        else:
            relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
        max_exact = num_buckets // 2
        is_small = relative_position < max_exact
        relative_position_if_large = max_exact + (
            torch.log(relative_position.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.long)
        relative_position_if_large = torch.min(
            relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
        )
        relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
        return relative_buckets

    def compute_bias(self, query_length, key_length, device=None, cache_position=None):
        if device is None:
            device = self.relative_attention_bias.weight.device
        if cache_position is None:
            context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        else:
            context_position = cache_position[:, None].to(device)
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        relative_position = memory_position - context_position
        relative_position_bucket = self._relative_position_bucket(
            relative_position, bidirectional=(not self.is_decoder), num_buckets=self.relative_attention_num_buckets,
            max_distance=self.relative_attention_max_distance)
        values = self.relative_attention_bias(relative_position_bucket)
        values = values.permute([2, 0, 1]).unsqueeze(0)
        return values

    def forward(self, hidden_states, mask=None, key_value_states=None, position_bias=None, query_length=None,
                cache_position=None):
        batch_size, seq_length = hidden_states.shape[:2]
        is_cross_attention = key_value_states is not None
        query_states = self.q(hidden_states)
        query_states = query_states.view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)
        current_states = key_value_states if is_cross_attention else hidden_states
        key_states = self.k(current_states)
        value_states = self.v(current_states)
        key_states = key_states.view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)
        value_states = value_states.view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)
        scores = torch.matmul(query_states, key_states.transpose(3, 2))
        if position_bias is None:
            key_length = key_states.shape[-2]
            real_seq_length = query_length if query_length is not None else cache_position[-1] + 1
            if not self.has_relative_attention_bias:
                position_bias = torch.zeros((1, self.n_heads, seq_length, key_length), device=scores.device,
                                            dtype=scores.dtype)
            else:
                position_bias = self.compute_bias(real_seq_length, key_length, device=scores.device,
                                                  cache_position=cache_position)
                position_bias = position_bias[:, :, -seq_length:, :]
            if mask is not None:
                causal_mask = mask[:, :, :, : key_states.shape[-2]]
                position_bias = position_bias + causal_mask
        position_bias_masked = position_bias
        scores += position_bias_masked
        attn_weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        attn_weights = F.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.view(batch_size, -1, self.inner_dim)
        attn_output = self.o(attn_output)
        return attn_output, position_bias


class T5LayerSelfAttention(nn.Module):
    def __init__(self, c, is_decoder, has_relative_attention_bias=False, device=None):
        super().__init__()
        self.SelfAttention = T5Attention(c, is_decoder, has_relative_attention_bias, device)
        self.layer_norm = T5LayerNorm(c.d_model, eps=c.layer_norm_epsilon, device=device)
        self.dropout = nn.Dropout(c.dropout_rate)

    def forward(self, hidden_states, attention_mask=None, position_bias=None, cache_position=None):
        normed_hidden_states = self.layer_norm(hidden_states)
        attention_output = self.SelfAttention(normed_hidden_states, mask=attention_mask, position_bias=position_bias,
                                              cache_position=cache_position)
        hidden_states = hidden_states + self.dropout(attention_output[0])
        return (hidden_states,) + attention_output[1:]


class T5LayerCrossAttention(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.EncDecAttention = T5Attention(c, True, has_relative_attention_bias=False, device=device)
        self.layer_norm = T5LayerNorm(c.d_model, eps=c.layer_norm_epsilon, device=device)
        self.dropout = nn.Dropout(c.dropout_rate)

    def forward(self, hidden_states, key_value_states, attention_mask=None, position_bias=None, query_length=None):
        normed_hidden_states = self.layer_norm(hidden_states)
        attention_output = self.EncDecAttention(normed_hidden_states, mask=attention_mask,
                                                key_value_states=key_value_states, position_bias=position_bias,
                                                query_length=query_length)
        layer_output = hidden_states + self.dropout(attention_output[0])
        return (layer_output,) + attention_output[1:]


class T5Block(nn.Module):
    def __init__(self, c, is_decoder, has_relative_attention_bias=False, device=None):
        super().__init__()
        self.is_decoder = is_decoder
        self.layer = nn.ModuleList()
        self.layer.append(T5LayerSelfAttention(c, is_decoder, has_relative_attention_bias, device))
        if self.is_decoder:
            self.layer.append(T5LayerCrossAttention(c, device))
        self.layer.append(T5LayerFF(c, device))

    def forward(self, hidden_states, attention_mask=None, position_bias=None, encoder_hidden_states=None,
                encoder_attention_mask=None, encoder_decoder_position_bias=None, cache_position=None):
        self_attention_outputs = self.layer[0](hidden_states, attention_mask=attention_mask,
                                               position_bias=position_bias, cache_position=cache_position)
        hidden_states = self_attention_outputs[0]
        attention_outputs = self_attention_outputs[1:]
        do_cross_attention = self.is_decoder and encoder_hidden_states is not None
        if do_cross_attention:
            cross_attention_outputs = self.layer[1](hidden_states, key_value_states=encoder_hidden_states,
                                                    attention_mask=encoder_attention_mask,
                                                    position_bias=encoder_decoder_position_bias,
                                                    query_length=cache_position[-1] + 1)
            hidden_states = cross_attention_outputs[0]
            attention_outputs = attention_outputs + cross_attention_outputs[1:]
        hidden_states = self.layer[-1](hidden_states)
        return (hidden_states,) + attention_outputs


class T5Stack(nn.Module):
    def __init__(self, c, embed_tokens, is_decoder, device=None):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.is_decoder = is_decoder
        n = c.num_decoder_layers if is_decoder else c.num_layers
        self.block = nn.ModuleList([T5Block(c, is_decoder, has_relative_attention_bias=bool(i == 0), device=device)
                                    for i in range(n)])
        self.final_layer_norm = T5LayerNorm(c.d_model, eps=c.layer_norm_epsilon, device=device)
        self.dropout = nn.Dropout(c.dropout_rate)

    def invert_attention_mask(self, encoder_attention_mask):
        """modeling_utils.ModuleUtilsMixin.invert_attention_mask, in self.dtype (the parameters')."""
        dtype = next(self.parameters()).dtype
        if encoder_attention_mask.dim() == 3:
            encoder_extended_attention_mask = encoder_attention_mask[:, None, :, :]
        if encoder_attention_mask.dim() == 2:
            encoder_extended_attention_mask = encoder_attention_mask[:, None, None, :]
        encoder_extended_attention_mask = encoder_extended_attention_mask.to(dtype=dtype)
        encoder_extended_attention_mask = (1.0 - encoder_extended_attention_mask) * torch.finfo(dtype).min
        return encoder_extended_attention_mask

    @staticmethod
    def _prepare_4d_causal_attention_mask_with_cache_position(attention_mask, sequence_length, target_length, dtype,
                                                              device, cache_position, batch_size):
        min_dtype = torch.finfo(dtype).min
        causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype, device=device)
        if sequence_length != 1:
            causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask *= torch.arange(target_length, device=device) > cache_position.reshape(-1, 1)
        causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1)
        if attention_mask is not None:
            causal_mask = causal_mask.clone()
            mask_length = attention_mask.shape[-1]
            padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :].to(causal_mask.device)
            padding_mask = padding_mask == 0
            causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(padding_mask, min_dtype)
        return causal_mask

    def forward(self, input_ids, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_shape[-1])
        inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_length = input_shape
        cache_position = torch.arange(0, seq_length, device=inputs_embeds.device)
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, seq_length, device=inputs_embeds.device)
        if self.is_decoder:
            # _update_causal_mask (eager, no cache): target_length = attention_mask.shape[-1]
            causal_mask = self._prepare_4d_causal_attention_mask_with_cache_position(
                attention_mask, sequence_length=seq_length, target_length=attention_mask.shape[-1],
                dtype=inputs_embeds.dtype, device=inputs_embeds.device, cache_position=cache_position,
                batch_size=batch_size)
        else:
            causal_mask = attention_mask[:, None, None, :]
            causal_mask = causal_mask.to(dtype=inputs_embeds.dtype)
            causal_mask = (1.0 - causal_mask) * torch.finfo(inputs_embeds.dtype).min
        if self.is_decoder and encoder_hidden_states is not None:
            encoder_extended_attention_mask = self.invert_attention_mask(encoder_attention_mask)
        else:
            encoder_extended_attention_mask = None
        position_bias = None
        encoder_decoder_position_bias = None
        hidden_states = self.dropout(inputs_embeds)
        for layer_module in self.block:
            layer_outputs = layer_module(hidden_states, attention_mask=causal_mask, position_bias=position_bias,
                                         encoder_hidden_states=encoder_hidden_states,
                                         encoder_attention_mask=encoder_extended_attention_mask,
                                         encoder_decoder_position_bias=encoder_decoder_position_bias,
                                         cache_position=cache_position)
            hidden_states = layer_outputs[0]
            position_bias = layer_outputs[1]
            if self.is_decoder and encoder_hidden_states is not None:
                encoder_decoder_position_bias = layer_outputs[2]
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return (hidden_states,)


class T5ForConditionalGeneration(nn.Module):
    """forward(input_ids, attention_mask, labels): the collator's batch (DataCollatorForSeq2Seq without a model:
    no decoder_input_ids, so the model shifts the labels itself)."""

    def __init__(self, cfg, device=None):
        super().__init__()
        c = resolve_t5_config(cfg)
        self.config = c
        self.vocab_size = c.vocab_size
        self.model_dim = c.d_model
        self.shared = nn.Embedding(c.vocab_size, c.d_model, device=device)
        self.encoder = T5Stack(c, self.shared, False, device)
        self.decoder = T5Stack(c, self.shared, True, device)
        if c.tie_word_embeddings:
            self.lm_head = None  # transformers' lm_head is a Linear whose weight is shared.weight
        else:
            self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False, device=device)

    def _shift_right(self, input_ids):
        shifted_input_ids = input_ids.new_zeros(input_ids.shape)
        shifted_input_ids[..., 1:] = input_ids[..., :-1].clone()
        shifted_input_ids[..., 0] = self.config.decoder_start_token_id
        shifted_input_ids.masked_fill_(shifted_input_ids == -100, self.config.pad_token_id)
        return shifted_input_ids

    def forward(self, input_ids, attention_mask, labels):
        encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        hidden_states = encoder_outputs[0]
        decoder_input_ids = self._shift_right(labels)
        decoder_outputs = self.decoder(input_ids=decoder_input_ids, encoder_hidden_states=hidden_states,
                                       encoder_attention_mask=attention_mask)
        sequence_output = decoder_outputs[0]
        if self.config.tie_word_embeddings:
            sequence_output = sequence_output * (self.model_dim ** -0.5)
        lm_logits = F.linear(sequence_output, self.shared.weight if self.lm_head is None else self.lm_head.weight)
        loss_fct = nn.CrossEntropyLoss(ignore_index=-100)
        loss = loss_fct(lm_logits.view(-1, lm_logits.size(-1)), labels.view(-1))
        return loss



def build_model(config, device=None, frozen=(), checkpointing="none", checkpoint_every=1):
    """A random-weight model for a config dict (a transformers config.json, nanoGPT GPTConfig keys, or an
    "mlp" layer stack). The model is in train mode and float32. `frozen`: parameter-name globs to freeze
    (freeze_parameters). `checkpointing`: "none" | "reentrant" | "non-reentrant", every `checkpoint_every`-th
    decoder layer (model.checkpoint_settings)."""
    t = config.get("model_type")
    if checkpointing not in CHECKPOINT_MODES:
        raise ValueError(f"checkpointing must be one of {CHECKPOINT_MODES}, got {checkpointing!r}")
    if checkpointing != "none" and t not in CHECKPOINTABLE:
        raise ValueError(f"gradient checkpointing is implemented for {', '.join(CHECKPOINTABLE)}, not {t!r}")
    if t == "nanogpt":
        m = NanoGPT(config, device)
    elif t == "gpt2":
        m = GPT2LMHeadModel(config, device)
    elif t in LLAMA_FAMILY and (config.get("architectures") or [""])[0].endswith("ForSequenceClassification"):
        m = LlamaForSequenceClassification(config, device)
    elif t in LLAMA_FAMILY:
        m = LlamaForCausalLM(config, device)
    elif t == "gpt_neox":
        m = GPTNeoXForCausalLM(config, device)
    elif t == "opt":
        m = OPTForCausalLM(config, device)
    elif t == "phi":
        m = PhiForCausalLM(config, device)
    elif t == "falcon":
        m = FalconForCausalLM(config, device)
    elif t == "mlp":
        m = MLPStack(config, device)
    elif t == "bert":
        m = build_bert(config, device)
    elif t == "roberta":
        m = build_roberta(config, device)
    elif t == "t5":
        m = T5ForConditionalGeneration(config, device)
    else:
        raise ValueError(f"unsupported model_type {t!r}; one of {', '.join(MODEL_TYPES)}")
    settings = None
    for mod in m.modules():
        if isinstance(getattr(mod, "checkpoint_settings", None), CheckpointSettings):
            settings = mod.checkpoint_settings
            break
    if settings is None:
        settings = CheckpointSettings()
    settings.mode = checkpointing
    settings.every = int(checkpoint_every)
    if settings.every < 1:
        raise ValueError("checkpoint_every must be >= 1")
    m.checkpoint_settings = settings  # the decoder stack's object (shared), reachable from the top model
    m.frozen_parameters = freeze_parameters(m, frozen)
    m.train()
    return m


def zero_dropout(config):
    """A copy of config with every dropout probability set to 0 (CPU dropout saves a float mask where CUDA
    saves a bool one, so the oracle runs without dropout)."""
    out = dict(config)
    for k, v in config.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and ("dropout" in k or "pdrop" in k):
            out[k] = 0.0
    if out.get("model_type") == "nanogpt":
        out["dropout"] = 0.0
    return out


def count_parameters(config):
    """(parameters, parameter tensors) of the model, built on the meta device (no memory)."""
    m = build_model(config, device="meta")
    params = list(m.parameters())
    return sum(p.numel() for p in params), len(params)
