// The seeds' closed forms, transcribed term by term. Comments quote the seed's symbols.
// B=micro-batch T=seq C=hidden L=layers NH=heads V=vocab I=ffn
#include "trainmem/formulas.h"

#include <fmt/format.h>

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

}  // namespace trainmem
