// Gradient checkpointing of one layer, as torch/utils/checkpoint.py runs it (PyTorch 2.x). transformers'
// GradientCheckpointingLayer calls checkpoint(partial(layer.__call__, **kwargs), hidden_states): the hidden
// state is the only checkpoint input; the mask and the rotary cos/sin ride in the partial.
#include "layers.h"

namespace trainmem::sim {

namespace {

// The layer's forward run again in backward: under the saved autocast state, in a new outermost autocast
// region (the recompute enters torch.autocast(**ctx.device_autocast_kwargs) while no other region is open,
// so its weight casts are cached afresh and the cache is cleared when it exits).
T rerun(Ctx& c, uint64_t l, T in, const LayerArgs& args, const LayerFn& fn) {
  const int32_t layer = c.layer;
  std::vector<T> outer_cache = std::move(c.ac_cache);
  c.ac_cache.clear();
  c.layer = static_cast<int32_t>(l);
  struct Restore {  // also when the recompute stops early (StopRecomputation)
    Ctx& c;
    int32_t layer;
    std::vector<T>& outer;
    ~Restore() {
      c.exit_autocast();
      c.ac_cache = std::move(outer);
      c.layer = layer;
    }
  } restore{c, layer, outer_cache};
  return fn(l, std::move(in), args);
}

}  // namespace

T checkpoint_reentrant(Ctx& c, uint64_t l, T hidden, const LayerArgs& args, std::shared_ptr<const LayerFn> fn) {
  // CheckpointFunction.forward: ctx.save_for_backward(*tensor_inputs); `with torch.no_grad(): outputs =
  // run_function(*args)`. No graph inside: each intermediate is freed as soon as nothing refers to it.
  T out;
  {
    const bool grad = c.e.grad_mode;
    c.e.grad_mode = false;
    out = (*fn)(l, hidden, args);
    c.e.grad_mode = grad;
  }
  // The node exists only when the input requires grad; otherwise the output does not, and the layer's
  // parameters get no gradient (PyTorch warns "None of the inputs have requires_grad=True").
  if (!hidden->requires_grad && c.e.grad_mode) {
    c.warn("a reentrant checkpoint's input does not require grad (frozen embeddings without "
           "enable_input_require_grads): as PyTorch warns \"None of the inputs have requires_grad=True\", no "
           "gradient flows through the checkpointed layers and their parameters get none");
  }
  // ctx.save_for_backward(*tensor_inputs): the hidden state, and the positional tensor arguments
  Saved saved{hidden};
  if (args.positional) {
    if (args.position) saved.push_back(args.position);
    if (args.mask) saved.push_back(args.mask);
  }
  Ctx* const cp = &c;
  c.e.record("CheckpointFunctionBackward", {&hidden}, {&out}, std::move(saved),
             [cp, l, args, fn](Engine& e, Node& node, Grads& g) {
               // detach_variable(ctx.saved_tensors): a leaf that requires grad, over the same storage
               T detached = e.requires_grad_leaf(node.saved[0]);
               T recomputed;
               {
                 const bool grad = e.grad_mode;
                 e.grad_mode = true;  // torch.enable_grad()
                 e.begin_recompute();
                 recomputed = rerun(*cp, l, detached, args, *fn);
                 e.end_recompute();
                 e.grad_mode = grad;
               }
               // torch.autograd.backward(outputs_with_grad, args_with_grad): the recomputed graph runs and is
               // freed node by node inside this node's backward
               if (recomputed && recomputed->requires_grad) e.backward(recomputed, g[0]);
               recomputed.reset();
               return Grads{e.take_leaf_grad(detached)};  // tuple(inp.grad for inp in detached_inputs)
             });
  return out;
}

T checkpoint_non_reentrant(Ctx& c, uint64_t l, T hidden, const LayerArgs& args, std::shared_ptr<const LayerFn> fn) {
  auto frame = std::make_shared<CheckpointFrame>();
  // torchtitan's SelectiveAC: ptd_checkpoint_wrapper(module, context_fn=lambda:
  // create_selective_checkpoint_contexts(policy), early_stop=False): the frame keeps the op outputs the policy
  // saves (Engine::sac_op) and the recompute runs the whole layer, taking those from the frame.
  if (c.checkpoint.mode == CheckpointPolicy::kSelective) {
    frame->selective = true;
    frame->early_stop = false;
  }
  frame->inputs.push_back(hidden);  // new_frame.save_inputs(*args): the positional arguments
  if (args.positional) {
    if (args.position) frame->inputs.push_back(args.position);
    if (args.mask) frame->inputs.push_back(args.mask);
  }
  const bool input_requires_grad = hidden->requires_grad;
  Ctx* const cp = &c;
  CheckpointFrame* const f = frame.get();
  frame->recompute = [cp, l, args, fn, f, input_requires_grad](Engine& e) {
    // recompute_fn(*args): the saved input, with the forward's requires_grad, so the same ops save the same
    // tensors in the same order
    T in = f->inputs.empty() ? T() : f->inputs[0];
    if (in && input_requires_grad) in = e.requires_grad_leaf(in);
    T out = rerun(*cp, l, std::move(in), args, *fn);
  };
  c.e.begin_packing(frame);
  T out;
  try {
    out = (*fn)(l, std::move(hidden), args);
  } catch (...) {
    c.e.end_packing();
    throw;
  }
  c.e.end_packing();
  return out;
}

}  // namespace trainmem::sim
