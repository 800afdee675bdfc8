// The simulated autograd engine and a few ops, on graphs small enough to count by hand (float32, no autocast,
// no cuBLAS workspace): what is freed when, what autograd saves, how gradients flow and accumulate, and a
// backward that runs forward code again and a backward inside it (what torch.utils.checkpoint needs).
//   x (4, 8), W0 (8, 8), W1 (16, 8), W2 (8, 16): x0 = x @ W0^T (128 B), h = x0 @ W1^T (256 B),
//   y = relu(h) (256 B), z = y @ W2^T (128 B), loss = z.sum() (4 B).
#include <gtest/gtest.h>

#include "sim/forward.h"
#include "sim/layers.h"
#include "sim/ops.h"

namespace trainmem::sim {
namespace {

constexpr uint64_t kX = 4 * 8 * 4, kH = 4 * 16 * 4, kW0 = 8 * 8 * 4, kW1 = 16 * 8 * 4, kW2 = 8 * 16 * 4;

uint64_t live(const Engine& e) { return e.live().total.value; }
uint64_t live(const Engine& e, Category c) { return e.live().by_category[static_cast<size_t>(c)].value; }

struct Net {
  Timeline tl;
  Engine e{&tl};
  Ctx c{e};
  T w0 = e.parameter(Shape{8, 8}, DType::kF32, 0, Label{"W0"});
  T w1 = e.parameter(Shape{16, 8}, DType::kF32, 1, Label{"W1"});
  T w2 = e.parameter(Shape{8, 16}, DType::kF32, 2, Label{"W2"});
  T x = e.leaf(Shape{4, 8}, DType::kF32, Category::kInputs, Label{"x"});

  // The segment a checkpoint would wrap: relu(x0 @ W1^T) @ W2^T.
  T segment(const T& in) {
    T y = relu(c, linear(c, in, w1, nullptr, "fc1"), "relu");
    return linear(c, y, w2, nullptr, "fc2");
  }
};

TEST(Engine, AStorageIsFreedWithItsLastReference) {
  Timeline tl;
  Engine e(&tl);
  T a = e.empty(Shape{4, 8}, DType::kF32, Category::kActivations, Label{"a"});
  T b = a;  // a second Python name for it
  EXPECT_EQ(live(e), kX);
  a.reset();
  EXPECT_EQ(live(e), kX);
  b.reset();
  EXPECT_EQ(live(e), 0u);
}

TEST(Engine, AViewSharesItsBaseStorage) {
  Timeline tl;
  Engine e(&tl);
  Ctx c(e);
  T a = e.empty(Shape{4, 8}, DType::kF32, Category::kActivations, Label{"a"});
  T v = view(c, a, Shape{32});
  EXPECT_EQ(tl.events.size(), 1u);  // no allocation for the view
  a.reset();
  EXPECT_EQ(live(e), kX);  // the view keeps the storage
}

TEST(Engine, AutogradSavesWhatTheBackwardFormulasNeed) {
  Net n;
  T x0 = linear(n.c, n.x, n.w0, nullptr, "fc0");
  T z = n.segment(x0);
  // mm saves both operands (x for W0's grad; x0 and y for W1's and W2's); relu saves its result; the
  // pre-activation h is dropped when relu returns. Parameters are not counted as saved activations.
  EXPECT_EQ(n.e.saved_bytes().value, kX + kX + kH);
  EXPECT_EQ(live(n.e, Category::kActivations), kX + kH + kX);  // x0, y, z
}

TEST(Engine, BackwardFreesTheGraphAndFillsEveryGrad) {
  Net n;
  T loss = sum_loss(n.c, n.segment(linear(n.c, n.x, n.w0, nullptr, "fc0")));
  n.e.backward(loss);
  EXPECT_EQ(live(n.e, Category::kGradients), kW0 + kW1 + kW2);
  EXPECT_EQ(n.e.saved_bytes().value, 0u);
  // What is left besides the model, its grads and the input: the loss the script still holds.
  EXPECT_EQ(live(n.e), kW0 + kW1 + kW2 + (kW0 + kW1 + kW2) + kX + 4);
}

TEST(Engine, AFrozenParameterGetsNoGradAndNoGraph) {
  Timeline tl;
  Engine e(&tl);
  Ctx c(e);
  T w = e.parameter(Shape{8, 8}, DType::kF32, 0, Label{"W"}, /*requires_grad=*/false);
  T x = e.leaf(Shape{4, 8}, DType::kF32, Category::kInputs, Label{"x"});
  T y = linear(c, x, w, nullptr, "fc");
  EXPECT_FALSE(y->requires_grad);  // no input requires grad: nothing is recorded, nothing saved
  EXPECT_EQ(e.saved_bytes().value, 0u);
}

TEST(Engine, GradientsOfTwoUsesAreSummed) {
  // y = x0 + x0: AddBackward0 hands the same gradient to both edges; the second is added into the first.
  Net n;
  T x0 = linear(n.c, n.x, n.w0, nullptr, "fc0");
  T loss = sum_loss(n.c, add(n.c, x0, x0, "x0 + x0"));
  n.e.backward(loss);
  EXPECT_EQ(live(n.e, Category::kGradients), kW0);
  EXPECT_EQ(live(n.e, Category::kBackward), 0u);
}

TEST(Engine, ALinearWeightUsedTwiceSumsItsTwoGradientsIntoAThirdTensor) {
  // Each MmBackward0 hands W0 a gradient that is a view (mm_mat2_backward's .t() of the product, transposed back
  // by TBackward0) whose base stays alive with it, so InputBuffer::accumulate cannot add into the first in place
  // (can_accumulate_inplace: its storage has a second owner): old + new is a new tensor. Real torch (1.13 on
  // CPU, /usr/bin/python3) runs aten.add.Tensor on a view there; HF GPT-2's tied wte in fp32 on an H100 makes a
  // 154,389,504 B sum at the embedding's backward.
  Net n;
  T x1 = linear(n.c, linear(n.c, n.x, n.w0, nullptr, "fc0"), n.w0, nullptr, "fc0 again");
  T loss = sum_loss(n.c, x1);
  const size_t before = n.tl.events.size();
  n.e.backward(loss);
  size_t weight_sized = 0;
  for (size_t i = before; i < n.tl.events.size(); ++i) {
    const Event& ev = n.tl.events[i];
    if (ev.kind == Event::kAlloc && ev.bytes.value == kW0) ++weight_sized;
  }
  EXPECT_EQ(weight_sized, 3u);  // the two gradients and their sum
  EXPECT_EQ(live(n.e, Category::kGradients), kW0);
  EXPECT_EQ(live(n.e, Category::kBackward), 0u);
}

// Reentrant checkpointing as torch/utils/checkpoint.py's CheckpointFunction does it: the segment runs under
// no_grad in forward (only its input is saved); its backward detaches the input, runs the segment again with
// grad enabled, and calls torch.autograd.backward on the recomputed output, inside the outer backward.
T checkpointed(Net& n, const T& in, uint64_t* peak_inside, Bytes* saved_inside) {
  T out;
  {
    n.e.grad_mode = false;  // torch.no_grad(): run_function(*args)
    out = n.segment(in);
    n.e.grad_mode = true;
  }
  n.e.record("CheckpointFunctionBackward", {&in}, {&out}, Saved{in},
             [&n, peak_inside, saved_inside](Engine& e, Node& node, Grads& g) {
               T detached = e.requires_grad_leaf(node.saved[0]);  // detach_variable(ctx.saved_tensors)
               T recomputed = n.segment(detached);                  // with torch.enable_grad()
               *saved_inside = e.saved_bytes();
               *peak_inside = live(e);
               e.backward(recomputed, g[0]);  // torch.autograd.backward(outputs, args)
               return Grads{e.take_leaf_grad(detached)};
             });
  return out;
}

TEST(Engine, ReentrantCheckpointSavesOnlyTheSegmentInput) {
  Net n;
  T x0 = linear(n.c, n.x, n.w0, nullptr, "fc0");
  uint64_t peak_inside = 0;
  Bytes saved_inside;
  T loss = sum_loss(n.c, checkpointed(n, x0, &peak_inside, &saved_inside));
  // fc0 saves x; the checkpoint saves x0; the segment's y was freed when the no_grad forward returned.
  EXPECT_EQ(n.e.saved_bytes().value, kX + kX);
  // x0 and the loss; the segment's output died with the expression (sum saves nothing but sizes)
  EXPECT_EQ(live(n.e, Category::kActivations), kX + 4);
}

TEST(Engine, ReentrantBackwardRecomputesAndGivesTheSameGrads) {
  Net plain;
  T loss = sum_loss(plain.c, plain.segment(linear(plain.c, plain.x, plain.w0, nullptr, "fc0")));
  plain.e.backward(loss);

  Net n;
  uint64_t peak_inside = 0;
  Bytes saved_inside;
  T loss2 = sum_loss(n.c, checkpointed(n, linear(n.c, n.x, n.w0, nullptr, "fc0"), &peak_inside, &saved_inside));
  n.e.backward(loss2);
  // Every parameter, inside and outside the segment, gets its .grad, as without checkpointing.
  EXPECT_EQ(live(n.e, Category::kGradients), live(plain.e, Category::kGradients));
  EXPECT_EQ(live(n.e, Category::kGradients), kW0 + kW1 + kW2);
  EXPECT_EQ(live(n.e), live(plain.e));  // and the same bytes are left when both are done
  EXPECT_EQ(n.e.saved_bytes().value, 0u);
  // Inside the checkpoint's backward, the recomputed segment holds what a normal forward would have saved
  // for it (x0 through the detached alias, y), besides the outer graph's x (fc0) and x0 (the checkpoint).
  EXPECT_EQ(saved_inside.value, kX + kX + kH);
  EXPECT_GT(peak_inside, 0u);
}

// A simulation abandoned with graphs alive (memoization's fallback, src/sim/memo.h rule 4, throws out of the
// pipeline loop mid-step): the engine's node chunks go to the per-thread pool cache with their stale fields, and a
// node recorded inside a non-reentrant checkpoint holds the region's frame, whose tensors belong to that engine.
// Engine::~Engine drops the frames, so the next engine, reusing those nodes, never releases a tensor into a
// destroyed one (before, the fallback's simulation failed or corrupted the heap: AddressSanitizer, make sanitize,
// reports a heap-use-after-free here without the fix).
TEST(Engine, AnEngineAbandonedWithACheckpointedGraphAliveLeavesNothingToTheNext) {
  std::weak_ptr<CheckpointFrame> frame;
  {
    Net n;
    auto fn = std::make_shared<const LayerFn>([&n](uint64_t, T h, const LayerArgs&) { return n.segment(h); });
    T out = checkpoint_non_reentrant(n.c, 0, linear(n.c, n.x, n.w0, nullptr, "fc0"), LayerArgs{}, fn);
    ASSERT_TRUE(out->grad_fn.node && out->grad_fn.node->frame);  // the region's last node holds the frame
    frame = out->grad_fn.node->frame;
    T loss = sum_loss(n.c, out);
    EXPECT_GT(n.e.live().total.value, kW0 + kW1 + kW2 + kX);  // the graph and the frame's input are alive
  }  // no backward: the engine goes with the graph alive
  EXPECT_TRUE(frame.expired());  // nothing in the pooled nodes keeps it
  Net n;  // its nodes come from the cached chunks
  for (int i = 0; i < 64; ++i) {
    T loss = sum_loss(n.c, n.segment(linear(n.c, n.x, n.w0, nullptr, "fc0")));
    n.e.backward(loss);
  }
  EXPECT_EQ(live(n.e, Category::kGradients), kW0 + kW1 + kW2);
}

TEST(Engine, AReentrantBackwardLeavesTheOuterCountsAlone) {
  // Two checkpointed segments in a row: the outer backward must still run the first after the second's
  // inner backward has run (its dependency counts survive), and reach W0.
  Net n;
  uint64_t p1 = 0, p2 = 0;
  Bytes s1, s2;
  T x0 = linear(n.c, n.x, n.w0, nullptr, "fc0");
  T a = checkpointed(n, x0, &p1, &s1);
  T b = checkpointed(n, a, &p2, &s2);
  T loss = sum_loss(n.c, b);
  n.e.backward(loss);
  EXPECT_EQ(n.e.backward_depth(), 0);
  EXPECT_GT(p1, 0u);  // the first segment's backward ran
  EXPECT_EQ(live(n.e, Category::kGradients), kW0 + kW1 + kW2);
  EXPECT_EQ(live(n.e, Category::kBackward), 0u);
}

}  // namespace
}  // namespace trainmem::sim
