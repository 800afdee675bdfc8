// The closed forms of the seed documents, exactly as written, for side-by-side comparison with the
// simulator. Each function cites its seed; none of them is used to produce trainmem's own estimate.
// B=micro-batch T=seq C=hidden L=layers NH=heads V=vocab I=ffn
#pragma once

#include <cstdint>
#include <vector>

#include "trainmem/inventory.h"
#include "trainmem/model.h"
#include "trainmem/setup.h"
#include "trainmem/units.h"

namespace trainmem {

// Seed 001, training-memory-kernel-v1. Llama-shaped parameter count:
//   P_embed = V*H, P_layer = 2H + 2H^2 + 2H*D_kv + 3H*I, P_norm = H, P_total = P_embed + L*P_layer + P_norm
// with D_kv = num_kv_heads * (H / num_attention_heads). M_weights = P*B_w (B_w 4 for fp32, 2 for fp16/bf16,
// 4+2 under mixed precision), M_grad = 4P, M_opt = 8P, M_act = L*S*H*K*4 with K = 10 (per single sequence),
// M_total = M_weights + M_grad + M_opt + M_act + M_cuda with M_cuda = 512 MB.
struct Seed001Contract {
  Elems p_embed, p_layer, p_norm, p_total;
  uint64_t bytes_per_weight = 0;
  Bytes weights, gradients, optimizer, activations, cuda, total;
};
inline constexpr uint64_t kSeed001ActivationTensorsK = 10;  // "Q, K, V, attn_scores, attn_out, gate, up, down, 2x residual"
// "M_cuda ~ 512 MB (CUDA context, cuBLAS workspace, allocator overhead)": read as 512 MiB, the unit the seed's
// other figures use.
inline constexpr uint64_t kSeed001CudaBytes = 512ull * 1024 * 1024;
Seed001Contract seed001_contract(const ModelSpec& m, const TrainSetup& s);

// Seed 002 (Korthikanti et al. 2022, as retold): activations per layer sbh(34 + 5as/h) = 34sbh + 5as^2b bytes
// (fp16 activations, 1-byte dropout masks), parameters P = 12Lh^2 + vh + sh (no biases or norms),
// weights 2P (fp16), gradients 2P (fp16), optimizer 12P (fp32 copy, momentum, variance: ZeRO's count).
struct Seed002Korthikanti {
  Bytes activations_per_layer, activations;
  Elems params;
  Bytes weights, gradients, optimizer, total;
};
Seed002Korthikanti seed002_korthikanti(const ModelSpec& m, const TrainSetup& s);

// Seed 002's FLOPs (after Korthikanti et al. 2022, appendix A, as retold): only the GEMMs of the layers count;
// per layer and step "3b(12sh^2 + 2s^2h)" in the seed's units, which halve the paper's ("my calculations are half of
// theirs"): multiply-adds. In FLOPs (2 per multiply-add) a layer's step is 6b(12sh^2 + 2s^2h): its forward
// 2b(12sh^2 + 2s^2h) and a backward of twice that. The form omits the output head, 6bshv in FLOPs (trainmem adds
// it beside), recomputation, attention's causal skip, biases, norms, elementwise ops and the optimizer.
// The 6N·tokens rule (Kaplan et al. 2020, "C = 6NBS"): 6 FLOPs per parameter and token, forward and backward.
struct Seed002Flops {
  uint64_t layer_macs = 0;      // 3b(12sh^2 + 2s^2h), the seed's per-layer figure
  uint64_t layers_flops = 0;    // 2 L 3b(12sh^2 + 2s^2h): every layer's forward and backward, in FLOPs
  uint64_t head_flops = 0;      // 6bshv: the output head's forward and backward (not in the seed)
  uint64_t six_n_tokens = 0;    // 6 N b s, N the inventory's parameters
};
Seed002Flops seed002_flops(const ModelSpec& m, const Inventory& inv, const TrainSetup& s);

// Seed 000 (nanoGPT under autocast): with Ne = B*T*C, Na = B*NH*T^2, Nl = B*T*V, N parameters, Nbuf buffer
// elements: M_act = L(36Ne + 6Na) + 6Ne + 6Nl, M_steady = 16N + 4Nbuf,
// M_peak = M_steady + M_act + 4Nl = L(36Ne + 6Na) + 6Ne + 10Nl + 16N + 4Nbuf.
struct Seed000Peak {
  Elems ne, na, nl, n, nbuf;
  Bytes activations, steady_state, peak;
};
Seed000Peak seed000_peak(const ModelSpec& m, const Inventory& inv, const TrainSetup& s);

// Seed 004 ("Breaking down GPU VRAM consumption", the VRAM calculator's components), for training and for
// inference: CUDA kernels ("between 300 MiB to 2000 MiB"), parameters (parameters + buffers: 4 bytes each in
// full precision, 6 under mixed precision, the load dtype's bytes for inference), activations (training: every
// layer's, per Korthikanti et al. sec 4.1, sbh(34 + 5as/h) per layer; inference: "only the current (single)
// layer's"), gradients ("always ... 4 bytes per parameter"; training only), optimizer states (SGD 0, SGD with
// momentum 4, Adam 8 bytes per parameter; training only), outputs (B x S x V float32; training also stores the
// softmax probabilities, "the same size as the output tensor"). No KV cache: the seed disables use_cache.
struct Seed004Calculator {
  bool training = true;
  Elems params;                   // parameters + buffers (inventory)
  uint64_t bytes_per_param = 0;
  Bytes cuda_low, cuda_high;      // the seed's range for the CUDA kernels
  Bytes parameters, activations_per_layer, activations, gradients, optimizer, outputs;
  Bytes total_low, total_high;    // the sum with either end of the kernels' range
};
inline constexpr uint64_t kSeed004CudaLowBytes = 300ull * 1024 * 1024;    // "between 300 MiB"
inline constexpr uint64_t kSeed004CudaHighBytes = 2000ull * 1024 * 1024;  // "to 2000 MiB"
Seed004Calculator seed004_calculator(const ModelSpec& m, const Inventory& inv, const TrainSetup& s);

// ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", arXiv
// 1910.02054), Table 1 and Figure 1: the model states per device of mixed-precision Adam over N data-parallel
// devices, with 2Ψ bytes of fp16 parameters, 2Ψ of fp16 gradients and KΨ of optimizer states:
//   baseline (2 + 2 + K)Ψ, P_os 2Ψ + 2Ψ + KΨ/N, P_os+g 2Ψ + (2 + K)Ψ/N, P_os+g+p (2 + 2 + K)Ψ/N
// (stages 1, 2 and 3 of DeepSpeed). The paper's quotients are real numbers; here they round down to whole bytes.
inline constexpr uint64_t kZeroPaperK = 12;  // "K = 12" for mixed-precision Adam: fp32 parameters, momentum, variance
struct ZeroPaperStates {
  Elems psi;
  uint64_t n = 1;
  Bytes baseline, os, os_g, os_g_p;
};
ZeroPaperStates zero_paper_states(Elems psi, uint64_t n);

// DeepSpeed's model-states estimators, transcribed from DeepSpeed edaa722 (0.19.6):
// deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs and stage3.py
// estimate_zero3_model_states_mem_needs, with additional_buffer_factor=1.5 (their default) and total_gpus =
// gpus_per_node * nodes. ZeRO-2: GPU 2Ψ + int(18Ψ/N), or 2Ψ with offload_optimizer=cpu; CPU 4Ψ·gpus_per_node·1.5,
// or Ψ·max(4N, 16)·1.5 with offload. ZeRO-3, with largest_layer_memory = 4·largest_layer_params: GPU
// largest + int(18Ψ/N), + int(2Ψ/N) with the optimizer offloaded, largest alone with parameters offloaded too;
// CPU per zero_init as the code writes it. DeepSpeed computes in Python floats and truncates with int(); here the
// exact quotient is rounded down (the same whole bytes unless a float rounds across an integer).
inline constexpr uint64_t kDeepSpeedBufferFactorNum = 3, kDeepSpeedBufferFactorDen = 2;  // additional_buffer_factor=1.5
struct DeepSpeedRow {
  bool offload_param = false, offload_optimizer = false, zero_init = true;
  Bytes cpu, gpu;
};
struct DeepSpeedEstimates {
  Elems total_params, largest_layer_params;
  uint64_t gpus_per_node = 1, nodes = 1;
  Bytes largest_layer_memory;
  std::vector<DeepSpeedRow> zero2;  // offload_optimizer cpu, then none (the order DeepSpeed prints)
  std::vector<DeepSpeedRow> zero3;  // (param, optimizer) offloaded: both, optimizer only, neither; zero_init 1 then 0
};
DeepSpeedEstimates deepspeed_estimates(Elems total_params, Elems largest_layer_params, uint64_t gpus_per_node,
                                       uint64_t nodes);
// DeepSpeed's model_to_params (stage3.py): the most parameters registered on one module itself
// (`m.parameters(recurse=False)`), over every module. From the inventory: rows grouped by the name up to the last
// dot. A tied head is not a row of its own; its module holds the embedding's weight, so the maximum is the same,
// except where the tied module also holds a tied bias: BERT/RoBERTa's masked-LM decoder (`self.decoder.bias =
// self.bias`), V x C + V in DeepSpeed's count, V x C here (the README says so).
Elems largest_module_params(const Inventory& inv);

}  // namespace trainmem
