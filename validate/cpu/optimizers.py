"""Transliterations of the memory-lean optimizers the CPU oracle's torch 1.13 lacks, kept to their sources'
tensor operations (so their state tensors, dtypes and shapes are the real ones).

* TransformersAdafactor: transformers src/transformers/optimization.py class Adafactor (transformers main,
  commit 005edacb6b5dabbf0843e92c6623de9e07ca6241; the same step since the Trainer's optim="adafactor"
  defaults: scale_parameter=True, relative_step=True, warmup_init=False, lr=None, beta1=None). Its state per
  parameter: step (int), exp_avg_sq_row / exp_avg_sq_col (factored, len(shape) >= 2) or exp_avg_sq, in the
  float32 of `grad.float()`, and RMS, a 0-d float32 tensor (_rms of the float32 parameter).
* TorchAdafactor: torch/optim/_adafactor.py (torch >= 2.5; pytorch main commit
  051d6a09bb159a48ac11006c454c0c979511d0f3) Adafactor._init_group and _single_tensor_adafactor (the path
  foreach=None takes). Its state per parameter: step (a CPU float32 0-d tensor), row_var / col_var
  (p.grad.new_zeros with shape[-1] = 1 / shape[-2] = 1, the gradient's dtype) or variance (zeros_like).
  torch 1.13 has torch.linalg.vector_norm and Tensor.lerp_, so the ops are the source's own.
"""

import math

import torch


class TransformersAdafactor(torch.optim.Optimizer):
    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                 weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False):
        defaults = dict(lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate, beta1=beta1,
                        weight_decay=weight_decay, scale_parameter=scale_parameter, relative_step=relative_step,
                        warmup_init=warmup_init)
        super().__init__(params, defaults)

    @staticmethod
    def _get_lr(param_group, param_state):
        rel_step_sz = param_group["lr"]
        if param_group["relative_step"]:
            min_step = 1e-6 * param_state["step"] if param_group["warmup_init"] else 1e-2
            rel_step_sz = min(min_step, 1.0 / math.sqrt(param_state["step"]))
        param_scale = 1.0
        if param_group["scale_parameter"]:
            param_scale = max(param_group["eps"][1], param_state["RMS"])
        return param_scale * rel_step_sz

    @staticmethod
    def _rms(tensor):
        return tensor.norm(2) / (tensor.numel() ** 0.5)

    @staticmethod
    def _approx_sq_grad(exp_avg_sq_row, exp_avg_sq_col):
        r_factor = (exp_avg_sq_row / exp_avg_sq_row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
        c_factor = exp_avg_sq_col.unsqueeze(-2).rsqrt()
        return torch.mul(r_factor, c_factor)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.dtype in {torch.float16, torch.bfloat16}:
                    grad = grad.float()
                state = self.state[p]
                grad_shape = grad.shape
                factored = len(grad_shape) >= 2
                use_first_moment = group["beta1"] is not None
                if len(state) == 0:
                    state["step"] = 0
                    if use_first_moment:
                        state["exp_avg"] = torch.zeros_like(grad)
                    if factored:
                        state["exp_avg_sq_row"] = torch.zeros(grad_shape[:-1]).to(grad)
                        state["exp_avg_sq_col"] = torch.zeros(grad_shape[:-2] + grad_shape[-1:]).to(grad)
                    else:
                        state["exp_avg_sq"] = torch.zeros_like(grad)
                    state["RMS"] = 0
                p_data_fp32 = p
                if p.dtype in {torch.float16, torch.bfloat16}:
                    p_data_fp32 = p_data_fp32.float()
                state["step"] += 1
                state["RMS"] = self._rms(p_data_fp32)
                lr = self._get_lr(group, state)
                beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
                update = (grad**2) + group["eps"][0]
                if factored:
                    exp_avg_sq_row = state["exp_avg_sq_row"]
                    exp_avg_sq_col = state["exp_avg_sq_col"]
                    exp_avg_sq_row.mul_(beta2t).add_(update.mean(dim=-1), alpha=(1.0 - beta2t))
                    exp_avg_sq_col.mul_(beta2t).add_(update.mean(dim=-2), alpha=(1.0 - beta2t))
                    update = self._approx_sq_grad(exp_avg_sq_row, exp_avg_sq_col)
                    update.mul_(grad)
                else:
                    exp_avg_sq = state["exp_avg_sq"]
                    exp_avg_sq.mul_(beta2t).add_(update, alpha=(1.0 - beta2t))
                    update = exp_avg_sq.rsqrt().mul_(grad)
                update.div_((self._rms(update) / group["clip_threshold"]).clamp_(min=1.0))
                update.mul_(lr)
                if use_first_moment:
                    exp_avg = state["exp_avg"]
                    exp_avg.mul_(group["beta1"]).add_(update, alpha=(1 - group["beta1"]))
                    update = exp_avg
                if group["weight_decay"] != 0:
                    p_data_fp32.add_(p_data_fp32, alpha=(-group["weight_decay"] * lr))
                p_data_fp32.add_(-update)
                if p.dtype in {torch.float16, torch.bfloat16}:
                    p.copy_(p_data_fp32)


class TorchAdafactor(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0):
        defaults = dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def _init_group(self, group, params_with_grad, grads, row_vars, col_vars, variances, state_steps):
        for p in group["params"]:
            if p.grad is None:
                continue
            params_with_grad.append(p)
            grads.append(p.grad)
            state = self.state[p]
            if len(state) == 0:
                # _get_scalar_dtype(): float32 (the default dtype), on the CPU
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                if p.grad.dim() > 1:
                    row_shape = list(p.grad.shape)
                    row_shape[-1] = 1
                    state["row_var"] = p.grad.new_zeros(row_shape)
                    col_shape = list(p.grad.shape)
                    col_shape[-2] = 1
                    state["col_var"] = p.grad.new_zeros(col_shape)
                else:
                    state["variance"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            row_vars.append(state.get("row_var", None))
            col_vars.append(state.get("col_var", None))
            variances.append(state.get("variance", None))
            state_steps.append(state["step"])

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params, grads, row_vars, col_vars, variances, steps = [], [], [], [], [], []
            self._init_group(group, params, grads, row_vars, col_vars, variances, steps)
            eps1, eps2 = group["eps"]
            _single_tensor_adafactor(params, grads, row_vars, col_vars, variances, steps, d=group["d"],
                                     lr=group["lr"], beta2_decay=group["beta2_decay"],
                                     weight_decay=group["weight_decay"], eps1=eps1, eps2=eps2)


def _single_tensor_adafactor(params, grads, row_vars, col_vars, variances, state_steps, *, d, lr, beta2_decay,
                             weight_decay, eps1, eps2):
    for i, param in enumerate(params):
        grad = grads[i]
        step_t = state_steps[i]
        row_var = row_vars[i]
        col_var = col_vars[i]
        variance = variances[i]
        if eps1 is None:
            eps1 = torch.finfo(param.dtype).eps
        step_t += 1
        step_float = step_t.item()
        one_minus_beta2_t = step_float**beta2_decay
        rho_t = min(lr, 1 / (step_float**0.5))
        alpha = max(eps2, param.norm(2).item() / (param.numel() ** 0.5)) * rho_t
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        if grad.dim() > 1:
            row_mean = torch.linalg.vector_norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
            row_var.lerp_(row_mean, one_minus_beta2_t)
            col_mean = torch.linalg.vector_norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
            col_var.lerp_(col_mean, one_minus_beta2_t)
            var_estimate = row_var @ col_var
            var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            grad_squared = grad * grad
            variance.lerp_(grad_squared, one_minus_beta2_t)
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        denom = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * d))
        param.add_(update, alpha=-alpha / denom)
