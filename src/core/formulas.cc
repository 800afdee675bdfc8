// The seeds' closed forms, transcribed term by term. Comments quote the seed's symbols.
// B=micro-batch T=seq C=hidden L=layers NH=heads V=vocab I=ffn
#include "trainmem/formulas.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <string_view>

#include "trainmem/error.h"
#include "trainmem/family.h"

namespace trainmem {

namespace {

// A product of sizes; `what` names the term in the overflow message.
uint64_t mul(std::string_view what, std::initializer_list<uint64_t> xs) {
  uint64_t r = 1;
  for (uint64_t x : xs) r = checked_mul(r, x, what);
  return r;
}

// The seeds' forms describe transformer language models: heads, a vocabulary, a sequence axis.
void require_transformer(const ModelSpec& m) {
  if (input_kind(m) != InputKind::kTokenIds || m.attn.heads == 0 || m.embed.vocab_size == 0) {
    throw Error(fmt::format("{}: the seeds' closed forms describe transformer language models (heads, a "
                            "vocabulary, a sequence); model_type \"{}\" is not one (trainmem estimate simulates it)",
                            m.name, m.model_type));
  }
}

}  // namespace

Seed001Contract seed001_contract(const ModelSpec& m, const TrainSetup& s) {
  require_transformer(m);
  const uint64_t V = m.embed.vocab_size, H = m.hidden, L = m.layers, I = m.mlp.ffn;
  // "D_kv: num_kv_heads x head_dim, head_dim: H / num_attention_heads"
  const uint64_t d_kv = mul("seed 001 D_kv", {m.attn.kv_heads, H / m.attn.heads});
  Seed001Contract c;
  c.p_embed = Elems(mul("seed 001 P_embed", {V, H}));
  c.p_layer = Elems(2 * H) + Elems(mul("seed 001 P_layer", {2, H, H})) + Elems(mul("seed 001 P_layer", {2, H, d_kv})) +
              Elems(mul("seed 001 P_layer", {3, H, I}));
  c.p_norm = Elems(H);
  c.p_total = c.p_embed + c.p_layer * L + c.p_norm;
  // "B_w: bytes per weight (4 for f32, 2 for fp16/bf16)"; "Mixed precision stores master weights in f32 +
  // fp16 copy: M_weights = P x (4 + 2)".
  c.bytes_per_weight = uses_autocast(s.precision) ? 4 + 2 : itemsize(param_dtype(s.precision));
  c.weights = Bytes(mul("seed 001 M_weights", {c.p_total.value, c.bytes_per_weight}));
  c.gradients = Bytes(mul("seed 001 M_grad", {c.p_total.value, 4}));  // "Gradients always f32 regardless of mixed precision"
  c.optimizer = Bytes(mul("seed 001 M_opt", {c.p_total.value, 8}));  // "M_opt = P x 4 (m) + P x 4 (v)"
  // "M_act = L x S x H x K x 4"; "activation memory is per single sequence" (the batch does not appear).
  c.activations = Bytes(mul("seed 001 M_act = L*S*H*K*4", {L, s.seq, H, kSeed001ActivationTensorsK, 4}));
  c.cuda = Bytes(kSeed001CudaBytes);
  c.total = c.weights + c.gradients + c.optimizer + c.activations + c.cuda;
  return c;
}

Seed002Korthikanti seed002_korthikanti(const ModelSpec& m, const TrainSetup& s) {
  require_transformer(m);
  const uint64_t sq = s.seq, b = s.batch, h = m.hidden, a = m.attn.heads, L = m.layers;
  const uint64_t v = m.embed.vocab_size;
  Seed002Korthikanti k;
  // "Activation memory per layer: sbh(34 + 5as/h) or 34sbh + 5as^2b"
  k.activations_per_layer = Bytes(mul("seed 002 34sbh", {34, sq, b, h})) + Bytes(mul("seed 002 5as^2b", {5, a, sq, sq, b}));
  k.activations = k.activations_per_layer * L;
  // "Total # parameters: Lh^2(3 + 1 + 8) + vh + sh"
  k.params = Elems(mul("seed 002 12Lh^2", {12, L, h, h})) + Elems(mul("seed 002 vh", {v, h})) +
             Elems(mul("seed 002 sh", {sq, h}));
  k.weights = Bytes(mul("seed 002 weights", {2, k.params.value}));     // "stored in FP16 ... each parameter takes 2 bytes"
  k.gradients = Bytes(mul("seed 002 gradients", {2, k.params.value}));   // "Total gradient memory consumption: 2 * (...)"
  k.optimizer = Bytes(mul("seed 002 optimizer", {12, k.params.value}));  // "for optimizer state: 12 * (...)"
  k.total = k.weights + k.activations + k.gradients + k.optimizer;
  return k;
}

Seed002Flops seed002_flops(const ModelSpec& m, const Inventory& inv, const TrainSetup& s) {
  require_transformer(m);
  const uint64_t sq = s.seq, b = s.batch, h = m.hidden, L = m.layers, v = m.embed.vocab_size;
  Seed002Flops f;
  // "Total FLOPs per layer: 3b*(12sh^2+2s^2h)"
  f.layer_macs = mul("seed 002 FLOPs", {3, b, checked_add(mul("seed 002 12sh^2", {12, sq, h, h}),
                                                          mul("seed 002 2s^2h", {2, sq, sq, h}), "seed 002 FLOPs")});
  f.layers_flops = mul("seed 002 FLOPs", {2, L, f.layer_macs});
  f.head_flops = mul("head FLOPs", {6, b, sq, h, v});
  f.six_n_tokens = mul("6N tokens", {6, parameter_count(inv).value, b, sq});
  return f;
}

Seed004Calculator seed004_calculator(const ModelSpec& m, const Inventory& inv, const TrainSetup& s) {
  require_transformer(m);
  Seed004Calculator c;
  c.training = s.task == Task::kTrain;
  // "under 'parameters' I assume 'parameters' + 'buffers'"
  c.params = parameter_count(inv) + buffer_elems(inv);
  // training: "in full precision, 4 bytes per parameter"; "Mixed precision ... in total it takes 6 bytes per
  // param"; a model trained in 16-bit (not in the seed) takes its dtype's bytes. Inference: "the number of bytes
  // per parameter when loading a model like .from_pretrained(..., torch_dtype=torch.float16)".
  c.bytes_per_param = c.training && uses_autocast(s.precision) ? 4 + 2 : itemsize(param_dtype(s.precision));
  c.parameters = Bytes(mul("seed 004 parameters", {c.params.value, c.bytes_per_param}));
  c.cuda_low = Bytes(kSeed004CudaLowBytes);
  c.cuda_high = Bytes(kSeed004CudaHighBytes);
  // "There are good estimations of activations size per layer in [Korthikanti et al.] section 4.1":
  // sbh(34 + 5as/h) = 34sbh + 5as^2b. "in inference, we only keep the current (single) layer's activations".
  const uint64_t sq = s.seq, b = s.batch, h = m.hidden, a = m.attn.heads;
  c.activations_per_layer = Bytes(mul("seed 004 34sbh", {34, sq, b, h})) + Bytes(mul("seed 004 5as^2b", {5, a, sq, sq, b}));
  c.activations = c.training ? c.activations_per_layer * m.layers : c.activations_per_layer;
  // "the output tensors (Batch Size x Sequence Length x Vocabulary Size) are almost always in float32";
  // "While training, we also need to store probabilities F.softmax(logits, dim=-1) ... the same size".
  c.outputs = Bytes(mul("seed 004 outputs", {s.batch, s.seq, m.embed.vocab_size, 4, c.training ? 2u : 1u}));
  if (c.training) {
    c.gradients = Bytes(mul("seed 004 gradients", {c.params.value, 4}));
    // "SGD 0, SGD w momentum 4, ADAM 8" bytes per parameter
    const uint64_t per = s.optimizer == Optimizer::kSgd ? 0 : s.optimizer == Optimizer::kSgdMomentum ? 4 : 8;
    c.optimizer = Bytes(mul("seed 004 optimizer states", {c.params.value, per}));
  }
  const Bytes rest = c.parameters + c.activations + c.gradients + c.optimizer + c.outputs;
  c.total_low = rest + c.cuda_low;
  c.total_high = rest + c.cuda_high;
  return c;
}

Seed000Peak seed000_peak(const ModelSpec& m, const Inventory& inv, const TrainSetup& s) {
  require_transformer(m);
  Seed000Peak p;
  p.ne = Elems(mul("N_e = B*T*C", {s.batch, s.seq, m.hidden}));                // "N_e = Bsz x T x D_model"
  p.na = Elems(mul("N_a = B*NH*T^2", {s.batch, m.attn.heads, s.seq, s.seq}));      // "N_a = Bsz x N_heads x T^2"
  p.nl = Elems(mul("N_l = B*T*V", {s.batch, s.seq, m.embed.vocab_size}));       // "N_l = Bsz x T x D_vocab"
  p.n = parameter_count(inv);
  p.nbuf = buffer_elems(inv);
  const uint64_t L = m.layers;
  // "M_activations = N_layers x (36N_e + 6N_a) + 6N_e + 6N_l"
  p.activations = Bytes(mul("seed 000 36LN_e", {L, 36, p.ne.value})) + Bytes(mul("seed 000 6LN_a", {L, 6, p.na.value})) +
                  Bytes(mul("seed 000 6N_e", {6, p.ne.value})) + Bytes(mul("seed 000 6N_l", {6, p.nl.value}));
  // "M_steady_state = 16N_param + 4N_buf"
  p.steady_state = Bytes(mul("seed 000 16N", {16, p.n.value})) + Bytes(mul("seed 000 4N_buf", {4, p.nbuf.value}));
  // "M_peak_memory = M_steady_state + M_activations + 4N_l"
  p.peak = p.steady_state + p.activations + Bytes(mul("seed 000 4N_l", {4, p.nl.value}));
  return p;
}

namespace {

// floor(a * b / c), the product checked
uint64_t mul_div(std::string_view what, uint64_t a, uint64_t b, uint64_t c) { return mul(what, {a, b}) / c; }

}  // namespace

ZeroPaperStates zero_paper_states(Elems psi, uint64_t n) {
  if (n == 0) throw Error("internal: ZeRO over zero devices");
  const uint64_t p = psi.value, K = kZeroPaperK;
  ZeroPaperStates z;
  z.psi = psi;
  z.n = n;
  z.baseline = Bytes(mul("ZeRO baseline (2 + 2 + K)Psi", {2 + 2 + K, p}));
  z.os = Bytes(checked_add(mul("ZeRO P_os 2Psi + 2Psi", {2 + 2, p}), mul_div("ZeRO P_os K*Psi/N", K, p, n), "ZeRO P_os"));
  z.os_g = Bytes(checked_add(mul("ZeRO P_os+g 2Psi", {2, p}), mul_div("ZeRO P_os+g (2 + K)Psi/N", 2 + K, p, n),
                             "ZeRO P_os+g"));
  z.os_g_p = Bytes(mul_div("ZeRO P_os+g+p (2 + 2 + K)Psi/N", 2 + 2 + K, p, n));
  return z;
}

DeepSpeedEstimates deepspeed_estimates(Elems total_params, Elems largest_layer_params, uint64_t gpus_per_node,
                                       uint64_t nodes) {
  if (gpus_per_node == 0 || nodes == 0) throw Error("internal: DeepSpeed's estimators over zero GPUs");
  const uint64_t P = total_params.value, N = mul("total_gpus", {nodes, gpus_per_node});
  // "cpu_mem * additional_buffer_factor" with the default 1.5, then int(): floor(x * 3 / 2)
  const auto buffered = [](uint64_t x) {
    return mul("DeepSpeed cpu_mem * additional_buffer_factor", {x, kDeepSpeedBufferFactorNum}) / kDeepSpeedBufferFactorDen;
  };
  DeepSpeedEstimates d;
  d.total_params = total_params;
  d.largest_layer_params = largest_layer_params;
  d.gpus_per_node = gpus_per_node;
  d.nodes = nodes;
  // stage_1_and_2.py: for cpu_offload in [True, False]
  //   True:  gpu_mem = 2 * total_params; cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
  //   False: gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
  //          cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
  const uint64_t two_p = mul("DeepSpeed 2 * total_params", {2, P});
  d.zero2.push_back({false, true, true, Bytes(buffered(mul("DeepSpeed ZeRO-2 cpu_mem", {P, std::max<uint64_t>(mul("4 * total_gpus", {4, N}), 16)}))),
                     Bytes(two_p)});
  d.zero2.push_back({false, false, true, Bytes(buffered(mul("DeepSpeed ZeRO-2 cpu_mem", {P, 4, gpus_per_node}))),
                     Bytes(checked_add(two_p, mul_div("DeepSpeed int(18 * total_params / total_gpus)", 18, P, N),
                                       "DeepSpeed ZeRO-2 gpu_mem"))});
  // stage3.py: largest_layer_memory = (4 * largest_layer_params); gpus_factor = 1 / num_nodes
  d.largest_layer_memory = Bytes(mul("DeepSpeed largest_layer_memory", {4, largest_layer_params.value}));
  const uint64_t L = d.largest_layer_memory.value;
  // total_params * k * gpus_factor * additional_buffer_factor: floor(P * k * 3 / (2 * nodes))
  const auto per_node = [&](uint64_t k) { return buffered(mul("DeepSpeed ZeRO-3 cpu_mem", {P, k})) / nodes; };
  // zero_init=0: total_params * max(4 * num_gpus_per_node, k * gpus_factor) * additional_buffer_factor, with
  // k * gpus_factor a float: the larger of the two products
  const auto no_init = [&](uint64_t k) {
    return std::max(buffered(mul("DeepSpeed ZeRO-3 cpu_mem", {P, 4, gpus_per_node})), per_node(k));
  };
  const uint64_t two_p_n = mul_div("DeepSpeed int(2 * total_params / total_gpus)", 2, P, N);
  const uint64_t eighteen_p_n = mul_div("DeepSpeed int(18 * total_params / total_gpus)", 18, P, N);
  for (bool zero_init : {true, false}) {  // the order estimate_zero3_model_states_mem_needs_all_cold prints
    d.zero3.push_back({true, true, zero_init, Bytes(zero_init ? per_node(18) : no_init(18)), Bytes(L)});
  }
  for (bool zero_init : {true, false}) {
    d.zero3.push_back({false, true, zero_init, Bytes(zero_init ? per_node(16) : no_init(16)),
                       Bytes(checked_add(L, two_p_n, "DeepSpeed ZeRO-3 gpu_mem"))});
  }
  for (bool zero_init : {true, false}) {
    // cpu_mem = largest_layer_params * 4 * num_gpus_per_node * 1.5 (zero_init) or total_params * 4 * ... (not)
    const uint64_t cpu = zero_init ? buffered(mul("DeepSpeed ZeRO-3 cpu_mem", {largest_layer_params.value, 4, gpus_per_node}))
                                   : buffered(mul("DeepSpeed ZeRO-3 cpu_mem", {P, 4, gpus_per_node}));
    d.zero3.push_back({false, false, zero_init, Bytes(cpu), Bytes(checked_add(L, eighteen_p_n, "DeepSpeed ZeRO-3 gpu_mem"))});
  }
  return d;
}

Elems largest_module_params(const Inventory& inv) {
  std::map<std::string_view, uint64_t> per_module;
  uint64_t best = 0;
  for (const TensorRow& r : inv.parameters) {
    const std::string_view name = r.name;
    const size_t dot = name.rfind('.');
    uint64_t& n = per_module[dot == std::string_view::npos ? std::string_view() : name.substr(0, dot)];
    n = checked_add(n, r.elems.value, "a module's parameters");
    best = std::max(best, n);
  }
  return Elems(best);
}

}  // namespace trainmem
