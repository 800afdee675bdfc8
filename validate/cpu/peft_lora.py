"""PEFT LoRA for the trainmem CPU oracle: a faithful transliteration of huggingface/peft's LoRA (vanilla LoRA on
nn.Linear and transformers' Conv1D), as get_peft_model(model, LoraConfig(...)) builds it for training.

PEFT is not installed here; the code below follows the PEFT source (huggingface/peft main, 0.20.1.dev0, commit
5d602fdb; the LoRA forward has been the same since 0.9):

  src/peft/peft_model.py        PeftModel.__init__: base_model = LoraModel(model, ...); then
                                base_model._cast_adapter_dtype(autocast_adapter_dtype=True by default); then, if
                                getattr(model, "is_gradient_checkpointing", True), prepare_model_for_gradient_
                                checkpointing -> model.enable_input_require_grads().
  src/peft/tuners/tuners_utils.py
                                BaseTuner.__init__ (self.model = model -> names base_model.model.<name>),
                                BaseTuner.inject_adapter (walk model.named_modules(), replace each match),
                                check_target_module_exists (key == t or key.endswith("." + t)),
                                _maybe_include_all_linear_layers ("all-linear": every nn.Linear / Conv1D except the
                                output embeddings), _mark_only_adapters_as_trainable, cast_adapter_dtype,
                                BaseTunerLayer._move_adapter_to_device_of_base_layer, BaseTunerLayer._cast_input_dtype,
                                _get_in_out_features.
  src/peft/tuners/lora/layer.py LoraLayer.__init__, LoraLayer.update_layer, LoraLayer.reset_lora_parameters,
                                Linear.__init__, Linear.forward, dispatch_default.
  src/peft/tuners/lora/model.py LoraModel._create_and_replace, LoraModel._replace_module,
                                LoraModel._prepare_adapter_config (default targets).
  src/peft/utils/constants.py   TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING,
                                INCLUDE_LINEAR_LAYERS_SHORTHAND = "all-linear".
  src/peft/tuners/lora/config.py LoraConfig defaults: r=8, lora_alpha=8, lora_dropout=0.0, bias="none",
                                init_lora_weights=True, use_rslora=False, lora_bias=False.

transformers pieces: PreTrainedModel.enable_input_require_grads (a forward hook on the input embeddings:
output.requires_grad_(True)); PreTrainedModel.gradient_checkpointing_enable calls it when _hf_peft_config_loaded.

Entry point: apply_lora(model, r, alpha, dropout, targets, adapter_dtype_fp32=True, enable_input_require_grads=False)
returns a PeftModel-like wrapper (parameters named base_model.model.<transformers name>).
"""

import math
import re

import torch
import torch.nn as nn

import models

ADAPTER_NAME = "default"  # get_peft_model(model, config, adapter_name="default")

# src/peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (the model types the oracle has)
TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING = {
    "gpt2": ["c_attn"],
    "opt": ["q_proj", "v_proj"],
    "gpt_neox": ["query_key_value"],
    "llama": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "mixtral": ["q_proj", "v_proj"],
    "gemma": ["q_proj", "v_proj"],
    "gemma2": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
    "qwen3": ["q_proj", "v_proj"],
    # "phi3", "qwen2_moe", "qwen3_moe" have no entry (constants.py@00073fe): PEFT raises "Please specify
    # `target_modules` ..." for them
}
INCLUDE_LINEAR_LAYERS_SHORTHAND = "all-linear"

# transformers PreTrainedModel.get_output_embeddings() / get_input_embeddings() of the reference models (module
# names as model.named_modules() gives them). nanoGPT and the mlp stack are not PreTrainedModels: PEFT excludes no
# output layer from "all-linear" for them and finds no input embeddings to hook.
_OUTPUT_EMBEDDINGS = {"gpt2": "lm_head", "opt": "lm_head", "gpt_neox": "embed_out",
                      **{t: "lm_head" for t in models.LLAMA_FAMILY}}
_INPUT_EMBEDDINGS = {"gpt2": "transformer.wte", "opt": "model.decoder.embed_tokens",
                     "gpt_neox": "gpt_neox.embed_in", **{t: "model.embed_tokens" for t in models.LLAMA_FAMILY}}

LORA_DEFAULTS = {"r": 8, "alpha": 8, "dropout": 0.0, "targets": None}  # LoraConfig defaults; None: per model


# ----------------------------------------------------------------------------------------------------------
# The spelling trainmem's CLI uses: --lora r=16,alpha=32,dropout=0.05,targets=q_proj+v_proj (or targets=all-linear)


def parse_lora_spec(spec):
    """'r=16,alpha=32,dropout=0.05,targets=q_proj+v_proj' -> {"r": 16, "alpha": 32, "dropout": 0.05,
    "targets": ["q_proj", "v_proj"]}; every field optional (LoraConfig defaults r=8, lora_alpha=8, lora_dropout=0.0,
    targets None = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[model_type]); targets=all-linear -> "all-linear".
    As trainmem's parse_lora: after targets=, names are separated by '+' or by commas up to the next key=value field
    (targets=q_proj,v_proj); "", "default" and "true" keep every default."""
    out = dict(LORA_DEFAULTS)
    spec = (spec or "").strip()
    if spec in ("", "default", "true"):
        return out
    targets = None
    in_targets = False
    for item in spec.split(","):
        item = item.strip()
        if "=" not in item:
            if not in_targets or not item:
                raise ValueError(f"--lora expects key=value fields (r, alpha, dropout, targets), got {item!r}")
            targets.append(item)
            continue
        k, v = (x.strip() for x in item.split("=", 1))
        in_targets = False
        if k == "r":
            out["r"] = int(v)
        elif k == "alpha":
            out["alpha"] = float(v) if any(c in v for c in ".eE") else int(v)
        elif k == "dropout":
            out["dropout"] = float(v)
        elif k == "targets":
            in_targets = True
            targets = [t for t in v.split("+") if t]
        else:
            raise ValueError(f"unknown --lora field {k!r} (r, alpha, dropout, targets)")
    if targets is not None:
        if any(t.lower() == INCLUDE_LINEAR_LAYERS_SHORTHAND for t in targets):
            if len(targets) > 1:
                raise ValueError("targets=all-linear alone, or a list of module names")
            out["targets"] = INCLUDE_LINEAR_LAYERS_SHORTHAND
        else:
            out["targets"] = targets
    if out["r"] <= 0:
        # LoraLayer.update_layer: "`r` should be a positive integer value but the value passed is {r}"
        raise ValueError(f"`r` should be a positive integer value but the value passed is {out['r']}")
    if not 0.0 <= out["dropout"] < 1.0:
        raise ValueError("lora dropout must be in [0, 1)")
    return out


def format_lora_spec(lora):
    """The inverse of parse_lora_spec for the fields present in `lora` (a dict)."""
    parts = []
    for k in ("r", "alpha", "dropout"):
        if lora.get(k) is not None:
            parts.append(f"{k}={lora[k]}")
    t = lora.get("targets")
    if t is not None:
        parts.append("targets=" + (t if isinstance(t, str) else "+".join(t)))
    return ",".join(parts)


# ----------------------------------------------------------------------------------------------------------
# The tuner layer


def _get_in_out_features(module):
    """tuners_utils._get_in_out_features: nn.Linear -> (in_features, out_features); transformers Conv1D ->
    module.weight.shape, i.e. (nx, nf) = (in, out) since Conv1D stores its weight transposed."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, models.Conv1D):
        in_features, out_features = module.weight.shape
        return in_features, out_features
    raise ValueError(f"LoRA supports nn.Linear and Conv1D here, not {type(module).__name__}")


class LoraLinear(nn.Module):
    """peft.tuners.lora.layer.Linear (vanilla LoRA; repr prefix "lora."). Registration order, which is the
    named_parameters() order: LoraLayer.__init__ assigns base_layer, then the ModuleDicts lora_dropout, lora_A, lora_B,
    (ParameterDicts lora_embedding_A/B, ModuleDict lora_magnitude_vector: empty for Linear); so a replaced module's
    parameters are base_layer.weight, [base_layer.bias], lora_A.default.weight, lora_B.default.weight."""

    # LoraLayer.adapter_layer_names / other_param_names
    adapter_layer_names = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
    other_param_names = ("r", "lora_alpha", "scaling", "lora_dropout", "use_dora", "use_rslora", "lora_bias")

    def __init__(self, base_layer, adapter_name, r, lora_alpha, lora_dropout, fan_in_fan_out=False,
                 is_target_conv_1d_layer=False, init_lora_weights=True, use_rslora=False, lora_bias=False):
        super().__init__()
        # ---- LoraLayer.__init__(self, base_layer)
        self.base_layer = base_layer
        self.r = {}
        self.lora_alpha = {}
        self.scaling = {}
        self.lora_dropout = nn.ModuleDict({})
        self.lora_A = nn.ModuleDict({})
        self.lora_B = nn.ModuleDict({})
        self.lora_embedding_A = nn.ParameterDict({})
        self.lora_embedding_B = nn.ParameterDict({})
        self._disable_adapters = False
        self.merged_adapters = []
        self.use_dora = {}
        self.use_rslora = {}
        self.lora_bias = {}
        self.lora_magnitude_vector = torch.nn.ModuleDict()
        # "flag to enable/disable casting of input to weight dtype during forward call"
        self.cast_input_dtype_enabled = True
        in_features, out_features = _get_in_out_features(self.get_base_layer())
        self.in_features = in_features
        self.out_features = out_features
        # ---- Linear.__init__
        self.fan_in_fan_out = fan_in_fan_out  # only used by merge (Conv1D: True); not by forward
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha, lora_dropout, init_lora_weights, use_rslora, lora_bias)
        self.is_target_conv_1d_layer = is_target_conv_1d_layer

    # BaseTunerLayer
    def get_base_layer(self):
        base_layer = self
        while hasattr(base_layer, "base_layer"):
            base_layer = base_layer.base_layer
        return base_layer

    @property
    def active_adapters(self):
        return [self._active_adapter] if isinstance(self._active_adapter, str) else self._active_adapter

    def update_layer(self, adapter_name, r, lora_alpha, lora_dropout, init_lora_weights, use_rslora, lora_bias):
        """LoraLayer.update_layer (vanilla LoRA)."""
        if r <= 0:
            raise ValueError(f"`r` should be a positive integer value but the value passed is {r}")
        self.r[adapter_name] = r
        self.lora_alpha[adapter_name] = lora_alpha
        if lora_dropout > 0.0:
            lora_dropout_layer = nn.Dropout(p=lora_dropout)
        else:
            lora_dropout_layer = nn.Identity()
        self.lora_dropout.update(nn.ModuleDict({adapter_name: lora_dropout_layer}))
        # Actual trainable parameters (created on the CPU in the default dtype, float32)
        self.lora_A[adapter_name] = nn.Linear(self.in_features, r, bias=False)
        self.lora_B[adapter_name] = nn.Linear(r, self.out_features, bias=lora_bias)
        self.lora_bias[adapter_name] = lora_bias
        if use_rslora:
            self.scaling[adapter_name] = lora_alpha / math.sqrt(r)
        else:
            self.scaling[adapter_name] = lora_alpha / r
        self.use_rslora[adapter_name] = use_rslora
        self.use_dora[adapter_name] = False
        if init_lora_weights:
            self.reset_lora_parameters(adapter_name, init_lora_weights)
        # "call this before init of the lora variants"
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters)

    def reset_lora_parameters(self, adapter_name, init_lora_weights):
        """LoraLayer.reset_lora_parameters, init_lora_weights=True: "initialize A the same way as the default for
        nn.Linear and B to zero"."""
        if init_lora_weights is not False and adapter_name in self.lora_A.keys():
            if init_lora_weights is True:
                nn.init.kaiming_uniform_(self.lora_A[adapter_name].weight, a=math.sqrt(5))
            elif init_lora_weights.lower() == "gaussian":
                nn.init.normal_(self.lora_A[adapter_name].weight, std=1 / self.r[adapter_name])
            else:
                raise ValueError(f"Unknown initialization {init_lora_weights=}")
            nn.init.zeros_(self.lora_B[adapter_name].weight)
            if self.lora_bias[adapter_name]:
                nn.init.zeros_(self.lora_B[adapter_name].bias)

    def _move_adapter_to_device_of_base_layer(self, adapter_name):
        """BaseTunerLayer._move_adapter_to_device_of_base_layer: the adapter takes the device AND the floating dtype of
        the base layer's weight (a bf16 base gives bf16 adapters here; cast_adapter_dtype upcasts them afterwards)."""
        weight = getattr(self.get_base_layer(), "weight", None)
        if weight is None:
            return
        target_device = weight.device
        target_dtype = weight.dtype if (weight.dtype.is_floating_point or weight.dtype.is_complex) else None
        for adapter_layer_name in self.adapter_layer_names + self.other_param_names:
            adapter_layer = getattr(self, adapter_layer_name, None)
            if not isinstance(adapter_layer, (nn.ModuleDict, nn.ParameterDict)):
                continue
            if adapter_name not in adapter_layer:
                continue
            if any(p.device.type == "meta" for p in adapter_layer.parameters()):
                continue
            item = adapter_layer[adapter_name]
            if target_dtype is not None:
                adapter_layer[adapter_name] = item.to(target_device, dtype=target_dtype)
            else:
                adapter_layer[adapter_name] = item.to(target_device)

    def set_adapter(self, adapter_names, inference_mode=False):
        """BaseTunerLayer.set_adapter: the active adapter's layers require grad."""
        if isinstance(adapter_names, str):
            adapter_names = [adapter_names]
        for layer_name in self.adapter_layer_names:
            module_dict = getattr(self, layer_name)
            for key, layer in module_dict.items():
                layer.requires_grad_((key in adapter_names) and not inference_mode)
        self._active_adapter = adapter_names

    def _cast_input_dtype(self, x, dtype):
        """BaseTunerLayer._cast_input_dtype (PEFT >= 0.15; before: x = x.to(lora_A.weight.dtype), the same, since
        Tensor.to returns self when the dtype already matches):
            if (not cast_input_dtype_enabled) or (x.dtype == dtype): return x
            return x.to(dtype=dtype)"""
        if x is None:
            return None
        if (not getattr(self, "cast_input_dtype_enabled", True)) or (x.dtype == dtype):
            return x
        return x.to(dtype=dtype)

    def forward(self, x, *args, **kwargs):
        """lora.Linear.forward, the unmerged path with no adapter_names (vanilla LoRA):
            result = self.base_layer(x, *args, **kwargs)
            torch_result_dtype = result.dtype
            for active_adapter in self.active_adapters:
                ...
                x = self._cast_input_dtype(x, lora_A.weight.dtype)
                result = result + lora_B(lora_A(dropout(x))) * scaling
            result = result.to(torch_result_dtype)"""
        result = self.base_layer(x, *args, **kwargs)
        torch_result_dtype = result.dtype
        lora_A_keys = self.lora_A.keys()
        for active_adapter in self.active_adapters:
            if active_adapter not in lora_A_keys:
                continue
            lora_A = self.lora_A[active_adapter]
            lora_B = self.lora_B[active_adapter]
            dropout = self.lora_dropout[active_adapter]
            scaling = self.scaling[active_adapter]
            x = self._cast_input_dtype(x, lora_A.weight.dtype)
            result = result + lora_B(lora_A(dropout(x))) * scaling
        result = result.to(torch_result_dtype)
        return result

    def extra_repr(self):
        return f"lora: r={self.r}, alpha={self.lora_alpha}, scaling={self.scaling}"


# ----------------------------------------------------------------------------------------------------------
# The wrappers: PeftModel(ForCausalLM) -> LoraModel (BaseTuner) -> the transformers model


class LoraModel(nn.Module):
    """peft.tuners.lora.model.LoraModel (BaseTuner): self.model = model, forward -> self.model.forward; missing
    attributes are forwarded to the wrapped model (BaseTuner.__getattr__)."""

    prefix = "lora_"

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.targeted_module_names = []
        self.active_adapter = ADAPTER_NAME

    def forward(self, *args, **kwargs):
        return self.model.forward(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":
                raise
            return getattr(self.model, name)


class PeftModel(nn.Module):
    """peft.peft_model.PeftModel(ForCausalLM): self.base_model = LoraModel(model, ...); forward -> base_model;
    missing attributes are forwarded to base_model (PeftModel.__getattr__). Parameter names are therefore
    base_model.model.<transformers name>."""

    def __init__(self, tuner):
        super().__init__()
        self.active_adapter = ADAPTER_NAME
        self.base_model = tuner

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self.base_model, name)


def _is_pretrained_model(model):
    return getattr(model, "config", None) is not None and model.__class__.__name__ in (
        "GPT2LMHeadModel", "LlamaForCausalLM", "GPTNeoXForCausalLM", "OPTForCausalLM")


def _model_type(model):
    cfg = getattr(model, "config", None)
    t = getattr(cfg, "model_type", None)
    if t is None and isinstance(model, models.GPT2LMHeadModel):
        t = "gpt2"
    if t is None and isinstance(model, models.GPTNeoXForCausalLM):
        t = "gpt_neox"
    if t is None and isinstance(model, models.OPTForCausalLM):
        t = "opt"
    return t


def check_target_module_exists(target_modules, key):
    """tuners_utils.check_target_module_exists (no exclude_modules, layers_to_transform, modules_to_save): a str is
    a regex that must fullmatch the key; a list/set matches the key itself or any key ending in "." + target."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, key) is not None
    if key in target_modules:
        return True
    return any(key.endswith(f".{t}") for t in target_modules)


def _maybe_include_all_linear_layers(target_modules, model, model_type):
    """tuners_utils._maybe_include_all_linear_layers: "all-linear" -> the names of every nn.Linear / Conv1D module,
    minus the output embeddings of a PreTrainedModel (model.get_output_embeddings(): lm_head, embed_out)."""
    if not (isinstance(target_modules, str) and target_modules.lower() == INCLUDE_LINEAR_LAYERS_SHORTHAND):
        return target_modules
    linear_classes = (torch.nn.Linear, models.Conv1D)
    linear_module_names = set()
    for name, module in model.named_modules():
        if isinstance(module, linear_classes):
            linear_module_names.add(name)
    module_names_to_exclude = set()
    if _is_pretrained_model(model):
        out_name = _OUTPUT_EMBEDDINGS.get(model_type)
        if out_name is not None:
            output_emb = model.get_submodule(out_name)
            # "ignore the last classification head for text generation models"
            last_module_name = next(name for name, module in model.named_modules() if module is output_emb)
            module_names_to_exclude.add(last_module_name)
    return linear_module_names - module_names_to_exclude


def _get_submodules(model, key):
    """peft.utils.other._get_submodules"""
    parent = model.get_submodule(".".join(key.split(".")[:-1]))
    target_name = key.split(".")[-1]
    target = model.get_submodule(key)
    return parent, target, target_name


def cast_adapter_dtype(model, adapter_name, autocast_adapter_dtype=True):
    """tuners_utils.cast_adapter_dtype: "Currently, this only upcasts float dtypes to float32" (float16, bfloat16;
    the float8 types too): every parameter of the adapter's entries in the tuner layers' ModuleDicts / ParameterDicts
    gets param.data = param.data.to(torch.float32)."""
    if not autocast_adapter_dtype:
        return
    dtypes_to_convert_to_fp32 = {torch.float16, torch.bfloat16}
    for module in model.modules():
        if not isinstance(module, LoraLinear):
            continue
        for submodule in module.modules():
            if not isinstance(submodule, (nn.ModuleDict, nn.ParameterDict)):
                continue
            if adapter_name not in submodule:
                continue
            if isinstance(submodule[adapter_name], nn.Parameter):
                if submodule[adapter_name].dtype in dtypes_to_convert_to_fp32:
                    submodule[adapter_name].data = submodule[adapter_name].data.to(torch.float32)
                continue
            for param in submodule[adapter_name].parameters():
                if param.dtype in dtypes_to_convert_to_fp32:
                    param.data = param.data.to(torch.float32)


def enable_input_require_grads(model, model_type):
    """transformers PreTrainedModel.enable_input_require_grads:
        def make_inputs_require_grads(module, input, output):
            output.requires_grad_(True)
        self._require_grads_hook = self.get_input_embeddings().register_forward_hook(make_inputs_require_grads)
    (5.x registers the same hook once per distinct input-embedding module of the PreTrainedModels it contains: here
    one.) The embeddings' output, frozen hence a leaf without grad_fn, becomes a leaf that requires grad: every op
    after it records a graph, and its AccumulateGrad node keeps it alive until the graph is freed."""
    name = _INPUT_EMBEDDINGS.get(model_type)
    if name is None or not _is_pretrained_model(model):
        raise ValueError(f"{model_type!r} exposes no input embeddings (get_input_embeddings) to hook")

    def make_inputs_require_grads(module, input, output):
        output.requires_grad_(True)

    model._require_grads_hook = model.get_submodule(name).register_forward_hook(make_inputs_require_grads)
    return model._require_grads_hook


def apply_lora(model, r=8, alpha=8, dropout=0.0, targets=None, adapter_dtype_fp32=True,
               enable_input_require_grads_hook=False):
    """get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets),
    autocast_adapter_dtype=adapter_dtype_fp32) on a reference model, in PEFT's order:

      1. LoraModel._prepare_adapter_config: targets None -> TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.
      2. _maybe_include_all_linear_layers ("all-linear").
      3. BaseTuner.inject_adapter: for key, module in list(model.named_modules()) (the list taken before any
         replacement), check_target_module_exists -> LoraModel._create_and_replace -> dispatch_default
         (nn.Linear: fan_in_fan_out False; Conv1D: fan_in_fan_out True, is_target_conv_1d_layer) ->
         lora.Linear(target, ...) (update_layer: lora_A/lora_B created in float32, then moved to the base layer's
         device AND dtype) -> _replace_module: setattr(parent, child_name, new_module) (same slot of the parent's
         _modules, so the order is kept).
      4. _mark_only_adapters_as_trainable: every parameter that is not an adapter parameter -> requires_grad False
         (bias="none").
      5. PeftModel.__init__: _cast_adapter_dtype(autocast_adapter_dtype) -> fp16/bf16 adapters upcast to fp32.
      6. enable_input_require_grads (PeftModel.__init__ does it when the model is already gradient-checkpointed;
         transformers' gradient_checkpointing_enable does it on a model with a PEFT config): only when asked here.

    `targets`: None (per-model default), "all-linear", or a list of module-name suffixes. A plain string other than
    "all-linear" is, as in PEFT, a regex that must fullmatch a module name. Returns the PeftModel wrapper."""
    model_type = _model_type(model)
    # 1. LoraModel._prepare_adapter_config
    if targets is None:
        targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
        if targets is None:
            raise ValueError("Please specify `target_modules` or `target_parameters`in `peft_config` "
                             f"(PEFT has no default LoRA targets for model_type {model_type!r})")
        targets = set(targets)
    elif isinstance(targets, (list, tuple)):
        targets = list(targets)
    # 2. all-linear
    targets = _maybe_include_all_linear_layers(targets, model, model_type)
    # 3. inject
    tuner = LoraModel(model)  # BaseTuner.__init__: self.model = model (before injection)
    named_modules = list(model.named_modules())
    targeted = []
    for key, module in named_modules:
        if not key:
            continue
        if any(key.startswith(t + ".") for t in targeted):
            continue  # inside an adapter layer made in this pass (not in the stale list anyway)
        if not check_target_module_exists(targets, key):
            continue
        parent, target, target_name = _get_submodules(model, key)
        if isinstance(target, nn.Linear):
            new_module = LoraLinear(target, ADAPTER_NAME, r, alpha, dropout, fan_in_fan_out=False)
        elif isinstance(target, models.Conv1D):
            new_module = LoraLinear(target, ADAPTER_NAME, r, alpha, dropout, fan_in_fan_out=True,
                                    is_target_conv_1d_layer=True)
        else:
            # LoraModel._create_new_module: "Target module ... is not supported. Currently, only the following
            # modules are supported: torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, ..., Conv1D ..."
            raise ValueError(f"Target module {key} ({type(target).__name__}) is not supported by this oracle "
                             "(nn.Linear and Conv1D only)")
        setattr(parent, target_name, new_module)
        targeted.append(key)
    if not targeted:
        raise ValueError(f"Target modules {targets} not found in the base model. "
                         "Please check the target modules and try again.")
    tuner.targeted_module_names = targeted
    # 4. BaseTuner._mark_only_adapters_as_trainable (adapter parameters found structurally: everything of a tuner
    #    layer except its base_layer)
    adapter_params = set()
    for m in model.modules():
        if isinstance(m, LoraLinear):
            for layer_name in LoraLinear.adapter_layer_names:
                for p in getattr(m, layer_name).parameters():
                    adapter_params.add(id(p))
    for _, p in model.named_parameters():
        if id(p) not in adapter_params:
            p.requires_grad = False
    # 5. PeftModel.__init__
    peft = PeftModel(tuner)
    cast_adapter_dtype(model, ADAPTER_NAME, autocast_adapter_dtype=adapter_dtype_fp32)
    # 6.
    if enable_input_require_grads_hook:
        enable_input_require_grads(model, model_type)
    peft.lora_info = {
        "r": r, "alpha": alpha, "scaling": alpha / r, "dropout": dropout,
        "targets": sorted(targets) if isinstance(targets, (set, list)) else targets,
        "targeted_modules": targeted,
        "adapter_dtype": str(next(iter(model.get_submodule(targeted[0]).lora_A.parameters())).dtype
                             ).replace("torch.", ""),
        "enable_input_require_grads": bool(enable_input_require_grads_hook),
    }
    return peft


def lora_parameter_rows(peft):
    """(name, shape, dtype, requires_grad) in named_parameters() order."""
    return [(n, list(p.shape), str(p.dtype).replace("torch.", ""), bool(p.requires_grad))
            for n, p in peft.named_parameters()]
