"""torchtune's chunked output head and CEWithChunkedOutputLoss, transliterated for the CPU oracle.

Sources (pytorch/torchtune):
  torchtune/modules/transformer.py TransformerDecoder.chunked_output:
      [self.output(chunk) for chunk in last_hidden_state.chunk(self.num_output_chunks, dim=1)]
  torchtune/modules/loss/ce_chunked_output_loss.py CEWithChunkedOutputLoss.forward / compute_cross_entropy
  recipes/full_finetune_single_device.py _loss_step: the labels shifted with
      torch.hstack((labels[..., 1:], self.ignore_labels_cache[: labels.shape[0]])), then `del logits`.

use_chunked_loss(model, n) replaces a reference ForCausalLM's forward (models.py) with that pair: the decoder's
final hidden states go through the head chunk by chunk and the loss upcasts one chunk at a time. Call it before
LoRA is applied (PEFT wraps the model; the head is not a LoRA target, and the forward looks its modules up when it
runs).
"""
import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def _decoder_and_head(model):
    # (the model without its head, the head) of each reference ForCausalLM in models.py
    for base, head in (("transformer", "lm_head"), ("gpt_neox", "embed_out"), ("model", "lm_head")):
        if hasattr(model, base) and hasattr(model, head):
            return getattr(model, base), getattr(model, head)
    raise ValueError(f"{type(model).__name__}: no decoder and head to chunk")


def ce_with_chunked_output_loss(logits, labels, num_output_chunks, ignore_index=IGNORE_INDEX):
    """CEWithChunkedOutputLoss.forward (torchtune/modules/loss/ce_chunked_output_loss.py)."""
    total_elements = (labels != ignore_index).sum()
    labels = [target_chunk.reshape(-1) for target_chunk in labels.tensor_split(num_output_chunks, dim=1)]
    logits = [logit_chunk.reshape(-1, logit_chunk.size(-1)) for logit_chunk in logits]
    total_loss = 0.0
    for logits_chunk, labels_chunk in zip(logits, labels):
        # compute_cross_entropy
        total_loss += F.cross_entropy(logits_chunk.float(), labels_chunk, ignore_index=ignore_index, reduction="sum")
    return total_loss / total_elements


def use_chunked_loss(model, num_output_chunks):
    if getattr(getattr(model, "config", None), "final_softcap", None) is not None:
        raise ValueError("final logit softcapping is not part of torchtune's chunked output head")

    def forward(input_ids, labels):
        decoder, head = _decoder_and_head(model)
        h = decoder(input_ids)
        logits = [head(chunk) for chunk in h.chunk(num_output_chunks, dim=1)]  # TransformerDecoder.chunked_output
        del h  # TransformerDecoder.forward returns; its `h` goes out of scope
        ignore_labels_cache = torch.full((labels.shape[0], 1), IGNORE_INDEX, dtype=labels.dtype)
        labels = torch.hstack((labels[..., 1:], ignore_labels_cache[: labels.shape[0]]))
        loss = ce_with_chunked_output_loss(logits, labels, num_output_chunks)
        del logits
        return loss

    model.forward = forward
    return model
