// bitsandbytes 4-bit bases (QLoRA): the storage of a quantized weight, against the byte formulas of the
// bitsandbytes source, and what the simulated step does with it.
#include <gtest/gtest.h>

#include <vector>

#include "test_util.h"
#include "trainmem/estimate.h"
#include "trainmem/fit.h"
#include "trainmem/scenario.h"

namespace trainmem {
namespace {

using testing::MapFileReader;

ResolvedScenario qlora(bool double_quant, const std::string& lora = "r=16") {
  Scenario s;
  s.model.model = "llama-2-7b";
  set_field(s, "overrides", "num_hidden_layers=1");
  set_field(s, "quantize", "nf4");
  set_field(s, "double_quant", double_quant ? "true" : "false");
  set_field(s, "precision", "bf16");
  set_field(s, "compute_dtype", "bf16");
  set_field(s, "batch", "1");
  set_field(s, "seq", "128");
  if (!lora.empty()) set_field(s, "lora", lora);
  return resolve(s, MapFileReader());
}

uint64_t quant_state_bytes(const Inventory& inv, const std::string& weight) {
  uint64_t b = 0;
  for (const TensorRow& r : inv.buffers) {
    if (r.name.rfind(weight + ".quant_state.", 0) == 0) b += stored_bytes(r, DType::kBF16).value;
  }
  return b;
}

const TensorRow& row(const Inventory& inv, const std::string& name) {
  for (const TensorRow& r : inv.parameters) {
    if (r.name == name) return r;
  }
  throw Error("no row " + name);
}

TEST(Qlora, FourBitStorageFollowsBitsandbytesFormulas) {
  // bitsandbytes functional.py quantize_4bit (blocksize 64), for n = 4096 x 4096 elements:
  //   packed data ((n + 1) // 2, 1) uint8; absmax (n / 64,) float32; code: the 16 NF4 values in float32.
  const uint64_t n = 4096ull * 4096;
  const ResolvedScenario plain = qlora(false);
  const TensorRow& q = row(plain.inventory, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_TRUE(q.packed_4bit);
  EXPECT_EQ(stored_bytes(q, DType::kBF16).value, n / 2);
  EXPECT_EQ(quant_state_bytes(plain.inventory, q.name), 4 * (n / 64) + 16 * 4);  // 0.5625 B per element, + code
  // Double quantization (compress_statistics): absmax in 8 bits (n / 64 bytes), quantize_blockwise's own
  // absmax (one float32 per 256 blocks), its 256-entry dynamic map, and the float32 offset.
  const ResolvedScenario dq = qlora(true);
  EXPECT_EQ(quant_state_bytes(dq.inventory, q.name), n / 64 + 4 * (n / 64 / 256) + 256 * 4 + 4 + 16 * 4);
  // bnb_4bit_quant_storage=bfloat16: `mod = dtype2bytes[quant_storage] * 2`, so ((n + 1) // 4, 1) bfloat16, the
  // same bytes; a size not divisible by 4 loses the floor's remainder (n = 6: one bfloat16, 2 bytes)
  ResolvedScenario bf = qlora(false);
  quantize_4bit_rows(bf.inventory, false, DType::kBF16);  // (re-marks the base rows; appends quant-state rows)
  const TensorRow& qb = row(bf.inventory, q.name);
  EXPECT_EQ(stored_dtype(qb, DType::kF32), DType::kBF16);
  EXPECT_EQ(stored_shape(qb), (std::vector<uint64_t>{n / 4, 1}));
  EXPECT_EQ(stored_bytes(qb, DType::kF32).value, n / 2);
  TensorRow six = qb;
  six.elems = Elems(6);
  EXPECT_EQ(stored_bytes(six, DType::kF32).value, 2u);
  // The head stays unquantized (llm_int8_skip_modules: lm_head), in float32 after prepare_model_for_kbit_training.
  const TensorRow& head = row(dq.inventory, "lm_head.weight");
  EXPECT_FALSE(head.packed_4bit);
  EXPECT_EQ(stored_dtype(head, DType::kBF16), DType::kF32);
}

TEST(Qlora, KbitPreparationTurnsOnReentrantCheckpointingAndInputGrads) {
  const ResolvedScenario r = qlora(true);
  EXPECT_EQ(r.setup.checkpointing, Checkpointing::kFull);
  EXPECT_EQ(r.setup.checkpoint_reentrant, std::optional<bool>(true));
  EXPECT_EQ(r.setup.input_require_grads, std::optional<bool>(true));
  // only the adapters train: r (in + out) per adapted q_proj and v_proj
  EXPECT_EQ(trainable_count(r.inventory).value, 16u * (4096 + 4096) * 2);
}

TEST(Qlora, TheDequantizedWeightIsATransientInForwardAndBackward) {
  // MatMul4Bit (bnb <= 0.49): F.dequantize_4bit(B) allocates out x in in QuantState.dtype (bf16 here) for the
  // matmul and frees it after; its backward does it again. Nothing of the base layer is saved.
  const Estimate e = estimate(qlora(false));
  const uint64_t w = 4096ull * 11008 * 2;  // an MLP weight, in bf16
  int forward = 0, backward = 0;
  for (const Event& ev : e.sim->timeline.events) {
    if (ev.kind != Event::kAlloc || ev.bytes.value != w) continue;
    if (std::string(ev.label.what).find("dequantized 4-bit weight") == std::string::npos) continue;
    (ev.phase == Phase::kBackward ? backward : forward)++;
  }
  // three MLP weights of the (one) layer, every step: in forward, again in the recompute (reentrant
  // checkpointing runs the layer again in backward), and in backward
  EXPECT_EQ(forward, 3 * 2);
  EXPECT_EQ(backward, 3 * 2 * 2);
}

TEST(Qlora, FitSearchesTheQuantizedModelNotTheFullOne) {
  Scenario s;
  s.model.model = "llama-2-7b";
  for (auto [f, v] : std::initializer_list<std::pair<const char*, const char*>>{
           {"quantize", "nf4"}, {"lora", "r=16"}, {"precision", "bf16"}, {"compute_dtype", "bf16"}, {"seq", "512"},
           {"gpu", "rtx-4090"}}) {
    set_field(s, f, v);
  }
  const FitResult r = fit(s, FitRequest{}, MapFileReader());
  ASSERT_TRUE(r.largest);  // a 7B model in bf16 (13.5 GB of weights alone) fits a 24 GB card only quantized
  EXPECT_LT(r.probes.front().peak_allocated.value, 8 * kGiB);
}

}  // namespace
}  // namespace trainmem
