"""The CPU oracle for trainmem --cp N: one ring-attention call on every CP rank, forward and backward, in real PyTorch.

torch 1.13 cannot run torch 2.9's context_parallel (no DTensor SDPA dispatch, no flash kernel on CPU), but the
rank-local computation can run: this file transliterates the forward of
torch/distributed/tensor/experimental/_context_parallel/_attention.py `_templated_ring_attention` (load
balancing on, is_causal=True, `_AllGatherRotater`, `_SDPAMerger` with convert_to_f32=True) line by line for
any rank (rank r runs r steps of the whole query against the first half of the received K/V, then the second
half of the query against all of it), with two stand-ins:
  * the all-gather (ft_c.all_gather_tensor(curr_buffer, gather_dim=0)) is a torch.cat of `size` copies of the
    sent buffer: one new 1-D tensor of size x numel, as the collective's output. The sent buffer is kept alive
    until the first next_buffer() (the wait), as trainmem assumes the functional collective holds its input
    until it is waited;
  * the flash kernel (aten._scaled_dot_product_flash_attention) allocates what trainmem's sdpa() models for it
    (ops_nn.cc): an output of (B, q, H, D) seen as (B, H, q, D), and a float32 (B, H, q) logsumexp.
Everything else (the contiguous() copies of k and v, the cat per step, the chunk views, the merges'
temporaries, the torch.cat of _partial_update, results()' .to(dtype)) is the real code on real tensors, and
measure.py's storage registry (a TorchDispatchMode holding C++ weak references) sees when each storage dies.

Compared, exactly: the peak of live bytes during the call above the live bytes before it, and the bytes the
call leaves alive (its output and logsumexp), against `trainmem timeline --by event --format json` over
layer 0's ring-attention call, for every rank of each row (`--cp-rank r`). The backward (_templated_ring_attention_backward: float32 accumulators, the K/V
all-gather again, the K/V gradients by _AllToAllRotater, whose permute_tensor is a torch.empty_like stand-in)
is transliterated the same way with the flash backward's stand-in returning empty_like(q, k, v); its peak is
compared without the kernel-internal scratch trainmem adds inside each flash backward (softmax_d, dq_accum,
GQA's expanded dk/dv), which no dispatch mode can see.

Usage:
    /usr/bin/python3 validate/cpu/ring_attention.py --trainmem build/trainmem
"""

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure  # noqa: E402


class AllGatherRotater:
    """_AllGatherRotater with the collective replaced by a local torch.cat (see the module docstring)."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size
        self._aggregated_buffer = None
        self._pending_input = None
        self._idx = 0

    def exchange_buffers(self, curr_buffer):
        self._idx += 1
        if self._aggregated_buffer is None:
            curr_buffer = curr_buffer.contiguous()
            self._aggregated_buffer = torch.cat([curr_buffer] * self._size)
            self._pending_input = curr_buffer  # held by the collective until waited

    def next_buffer(self):
        idx = self._rank - self._idx
        self._pending_input = None  # _maybe_wait: the all-gather is done
        return self._aggregated_buffer.chunk(self._size)[idx]


class AllToAllRotater:
    """_AllToAllRotater with ft_c.permute_tensor replaced by torch.empty_like (the collective's new output); the
    sent buffer is kept alive until next_buffer() (the wait), as for the all-gather."""

    def __init__(self):
        self._buffer = None
        self._pending_input = None

    def exchange_buffers(self, curr_buffer):
        curr_buffer = curr_buffer.contiguous()
        self._buffer = torch.empty_like(curr_buffer)
        self._pending_input = curr_buffer

    def next_buffer(self):
        self._pending_input = None
        return self._buffer


def _partial_update(original, new, dim, n_chunks, idx, add):
    chunks = list(original.chunk(n_chunks, dim=dim))
    assert chunks[idx].shape == new.shape, (original.shape, new.shape, idx)
    if add:
        chunks[idx] += new
    else:
        chunks[idx] = new
    return torch.cat(chunks, dim=dim)


class SDPAMerger:
    def __init__(self, convert_to_f32, seq_dim):
        self._seq_dim = seq_dim
        self._out = None
        self._lse = None
        self._should_lse_squeeze = False
        self._convert_to_f32 = convert_to_f32
        self._out_dtype = torch.float32
        self._lse_dtype = torch.float32

    def _merge_one(self, block_out, block_lse, partial):
        if len(block_lse.shape) < len(block_out.shape):
            block_lse = block_lse.unsqueeze(dim=-1)
            self._should_lse_squeeze = True
        if self._lse is None:
            self._lse = block_lse
            self._out = block_out
        else:
            lse = self._lse.chunk(2, dim=self._seq_dim)[1] if partial else self._lse
            out = self._out.chunk(2, dim=self._seq_dim)[1] if partial else self._out
            out = out - F.sigmoid(block_lse - lse) * (out - block_out)
            lse = lse - F.logsigmoid(lse - block_lse)
            if partial:
                self._lse = _partial_update(self._lse, lse, dim=self._seq_dim, n_chunks=2, idx=1, add=False)
                self._out = _partial_update(self._out, out, dim=self._seq_dim, n_chunks=2, idx=1, add=False)
            else:
                self._lse = lse
                self._out = out

    def step(self, out, lse, partial):
        self._out_dtype = out.dtype
        self._lse_dtype = lse.dtype
        if self._convert_to_f32:
            out = out.to(torch.float32)
            lse = lse.to(torch.float32)
        self._merge_one(out, lse, partial)

    def results(self):
        out = self._out.to(self._out_dtype)
        if self._should_lse_squeeze:
            lse = self._lse.squeeze(-1).to(self._lse_dtype)
        else:
            lse = self._lse.to(self._lse_dtype)
        return out, lse


def flash_stand_in(q, k, v, is_causal):
    """What the flash kernel allocates (trainmem ops_nn.cc sdpa: (B, L, H, D) output, float32 (B, H, L))."""
    B, H, L, D = q.shape
    out = torch.empty(B, L, H, D, dtype=q.dtype).transpose(1, 2)
    lse = torch.empty(B, H, L, dtype=torch.float32)
    return out, lse


def templated_ring_attention(rank, size, query, key, value, is_causal=True):
    """_templated_ring_attention, load balancing on (enable_load_balance=True), for rank `rank`."""
    next_kv = None
    key = key.contiguous()
    value = value.contiguous()
    sdpa_merger = SDPAMerger(True, seq_dim=2)
    rotater = AllGatherRotater(rank, size)
    for i in range(size):
        if i > 0:
            next_kv = rotater.next_buffer()
            key = next_kv[: key.numel()].reshape(key.shape)
            value = next_kv[key.numel():].reshape(value.shape)
        if i < (size - 1):
            next_kv = torch.cat([key.flatten(), value.flatten()])
            next_kv = rotater.exchange_buffers(next_kv)
        if i == 0:
            q, k, v, partial = (query, key, value, False)
        elif i <= rank:
            q, k, v, partial = (query, key.chunk(2, dim=2)[0], value.chunk(2, dim=2)[0], False)
        else:
            q, k, v, partial = query.chunk(2, dim=2)[1], key, value, True
        out, logsumexp = flash_stand_in(q, k, v, is_causal=(i == 0))
        sdpa_merger.step(out, logsumexp, partial)
    return sdpa_merger.results()


class _Sampling(measure._StorageRegistry):
    """measure's registry, with the live bytes sampled after every op while `sampling` is on."""

    def __init__(self):
        super().__init__()
        self.sampling = False
        self.samples = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        r = super().__torch_dispatch__(func, types, args, kwargs)
        if self.sampling:
            self.samples.append(self.live_bytes())
        return r

    def live_bytes(self):
        return sum(row[1] for row in self.live())


def flash_backward_stand_in(grad_out, q, k, v, out, lse, is_causal):
    """What the flash backward returns (ops_nn.cc: dq, dk, dv = empty_like(q, k, v)); its kernel-internal
    float32 scratch (softmax_d, dq_accum) and GQA's expanded dk/dv are not visible here and are left out on
    trainmem's side too."""
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def templated_ring_attention_backward(rank, size, grad_out, query, key, value, out, logsumexp, is_causal=True):
    """_templated_ring_attention_backward, load balancing on, convert_to_f32=True, for rank `rank`."""
    seq_dim = 2
    next_kv = None
    next_grad_kv = None
    grad_query_, grad_key_, grad_value_ = None, None, None
    accum_dtype = torch.float32
    grad_query = torch.zeros_like(query, dtype=accum_dtype)
    grad_key = torch.zeros_like(key, dtype=accum_dtype)
    grad_value = torch.zeros_like(value, dtype=accum_dtype)
    key = key.contiguous()
    value = value.contiguous()
    kv_rotater = AllGatherRotater(rank, size)
    dkv_rotater = AllToAllRotater()
    for i in range(size):
        if i > 0:
            buffer = kv_rotater.next_buffer()
            pointer = 0
            key = buffer[pointer: pointer + key.numel()].reshape(key.shape)
            pointer += key.numel()
            value = buffer[pointer: pointer + value.numel()].reshape(value.shape)
            pointer += value.numel()
        if i != size - 1:
            next_kv = torch.cat([key.flatten(), value.flatten()])
            kv_rotater.exchange_buffers(next_kv)
        if i == 0:
            q, k, v, out_, dout, lse = (query, key, value, out, grad_out, logsumexp)
        elif i <= rank:
            q, k, v, out_, dout, lse = (query, key.chunk(2, dim=seq_dim)[0], value.chunk(2, dim=seq_dim)[0], out,
                                        grad_out, logsumexp)
        else:
            q, k, v, out_, dout, lse = (query.chunk(2, dim=seq_dim)[1], key, value, out.chunk(2, dim=seq_dim)[1],
                                        grad_out.chunk(2, dim=seq_dim)[1],
                                        logsumexp.chunk(2, dim=seq_dim)[1].contiguous())
        grad_query_, grad_key_, grad_value_ = flash_backward_stand_in(dout, q, k, v, out_, lse, i == 0)
        if i == 0:
            grad_key += grad_key_
            grad_value += grad_value_
        else:
            pointer = 0
            next_grad_kv = dkv_rotater.next_buffer()
            grad_key = next_grad_kv[pointer: pointer + grad_key.numel()].reshape(grad_key.shape)
            pointer += grad_key.numel()
            grad_value = next_grad_kv[pointer: pointer + grad_value.numel()].reshape(grad_value.shape)
            if i <= rank:
                grad_key = _partial_update(grad_key, grad_key_, dim=seq_dim, n_chunks=2, idx=0, add=True)
                grad_value = _partial_update(grad_value, grad_value_, dim=seq_dim, n_chunks=2, idx=0, add=True)
            else:
                grad_key += grad_key_
                grad_value += grad_value_
        next_grad_kv = torch.cat([grad_key.flatten(), grad_value.flatten()])
        dkv_rotater.exchange_buffers(next_grad_kv)
        if i <= rank:
            grad_query += grad_query_
        else:
            grad_query = _partial_update(grad_query, grad_query_, dim=seq_dim, n_chunks=2, idx=1, add=True)
    grad_query = grad_query.to(query.dtype)
    next_grad_kv = dkv_rotater.next_buffer().to(key.dtype)
    grad_key = next_grad_kv[: grad_key.numel()].reshape(grad_key.shape)
    grad_value = next_grad_kv[grad_key.numel():].reshape(grad_value.shape)
    return grad_query, grad_key, grad_value


def _qkv(B, H, Hk, L, D):
    """q, k, v as transformers' LlamaAttention leaves them: (B, L, heads, D) views transposed to (B, heads, L, D)."""
    return tuple(torch.empty(B, L, h, D, dtype=torch.bfloat16).transpose(1, 2) for h in (H, Hk, Hk))


def oracle_backward(B, H, Hk, L, D, size, rank=0):
    """The peak of live bytes during the backward call above those before it."""
    reg = _Sampling()
    with reg:
        # the saved q, k, v (transposed views, as in forward), the ring's output ((B, H, L, D), contiguous: a
        # torch.cat's .to(dtype) for rank 0) and logsumexp, and the incoming gradient
        q, k, v = _qkv(B, H, Hk, L, D)
        out = torch.empty(B, H, L, D, dtype=torch.bfloat16)
        lse = torch.empty(B, H, L, dtype=torch.float32)
        grad_out = torch.empty(B, H, L, D, dtype=torch.bfloat16)
        reg.mark("before")
        base = reg.live_bytes()
        reg.sampling = True
        dq, dk, dv = templated_ring_attention_backward(rank, size, grad_out, q, k, v, out, lse)
        reg.sampling = False
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    return max([base] + reg.samples) - base


def oracle(B, H, Hk, L, D, size, rank=0):
    """(peak live bytes during the call above those before it, bytes the call leaves alive)."""
    reg = _Sampling()
    with reg:
        q, k, v = _qkv(B, H, Hk, L, D)
        reg.mark("before")
        base = reg.live_bytes()
        reg.sampling = True
        out, lse = templated_ring_attention(rank, size, q, k, v)
        reg.sampling = False
        reg.mark("after")
        end = reg.live_bytes()
    assert out.shape == (B, H, L, D) and lse.shape == (B, H, L)
    return max([base] + reg.samples) - base, end - base


def _timeline_rows(exe, seq, cp, tp=1, rank=0):
    """trainmem's event rows for one step of a one-layer TinyLlama at --seq seq --cp cp --cp-rank rank (--tp tp:
    TP rank 0)."""
    args = [exe, "timeline", "--model", "tinyllama-1.1b", "--set", "num_hidden_layers=1", "--batch", "1",
            "--seq", str(seq), "--cp", str(cp), "--cp-rank", str(rank), "--steps", "1", "--by", "event",
            "--format", "json"]
    if tp > 1:
        args += ["--tp", str(tp)]
    return json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)["rows"]


def trainmem_call(exe, seq, cp, tp=1, rank=0):
    rows = _timeline_rows(exe, seq, cp, tp, rank)
    # the call's first allocation: key.contiguous()'s copy, or with one KV head (tp 4: a (B, 1, L, D) transpose is
    # contiguous, torch returns it as it is) the first K/V cat
    first = next(i for i, r in enumerate(rows) if r["tensor"].startswith("model.layers.0 cp "))
    base = rows[first - 1]["live_total_bytes"]
    out_at = next(i for i, r in enumerate(rows) if r["tensor"].endswith("sdpa output (ring attention)"))
    last = out_at
    while last + 1 < len(rows) and rows[last + 1]["kind"] == "free":
        last += 1
    peak = max(r["live_total_bytes"] for r in rows[first:last + 1])
    return peak - base, rows[last]["live_total_bytes"] - base


# the flash backward's kernel-internal scratch (ops_nn.cc sdpa / cp_attention.cc): invisible to the registry
KERNEL_INTERNAL = ("flash softmax_d", "flash dq_accum", "flash dk_expanded", "flash dv_expanded")


def trainmem_backward_call(exe, seq, cp, tp=1, rank=0):
    """The peak of live bytes over layer 0's ring-attention backward node above those before it, without the
    kernel-internal scratch: from the node's first allocation to its last (the returned dk/dv buffer)."""
    rows = _timeline_rows(exe, seq, cp, tp, rank)
    first = next(i for i, r in enumerate(rows) if r["tensor"] == "model.layers.0 cp grad_query fp32")
    # the node's returned gradients come after its last named allocation: dq, then the one dk/dv buffer
    last = max(i for i, r in enumerate(rows) if r["phase"] == "backward" and r["tensor"].startswith("model.layers.0 cp "))
    last += 1
    while rows[last]["kind"] != "alloc":
        last += 1
    last += 1
    while rows[last]["kind"] != "alloc":
        last += 1
    live = peak = 0
    for r in rows[first:last + 1]:
        if any(r["tensor"].endswith(k) for k in KERNEL_INTERNAL):
            continue
        live += r["bytes"] if r["kind"] == "alloc" else -r["bytes"] if r["kind"] == "free" else 0
        peak = max(peak, live)
    return peak


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainmem", required=True)
    a = ap.parse_args(argv)
    failures = 0
    # TinyLlama's attention: 32 heads, 4 KV heads of 64. Under --tp T (transformers' tp_plan: q/k/v_proj colwise)
    # the call's q, k, v are TP rank 0's plain local tensors of 32/T and 4/T heads (tp.h), so torch's ring runs on
    # those: the oracle is the same transliteration with the local head counts
    rows = ((256, 2, 1), (256, 4, 1), (512, 8, 1), (256, 2, 2), (512, 4, 4))
    checks = 0
    for seq, cp, tp in rows:
        L = seq // cp
        H, Hk = 32 // tp, 4 // tp
        for rank in range(cp):
            tag = f"seq {seq} cp {cp}" + (f" tp {tp}" if tp > 1 else "") + f" rank {rank}"
            want = oracle(1, H, Hk, L, 64, cp, rank)
            got = trainmem_call(a.trainmem, seq, cp, tp, rank)
            ok = want == got
            failures += not ok
            print(f"{'ok ' if ok else 'BAD'} {tag}: torch peak/left {want[0]:,}/{want[1]:,} B, "
                  f"trainmem {got[0]:,}/{got[1]:,} B")
            want_b = oracle_backward(1, H, Hk, L, 64, cp, rank)
            got_b = trainmem_backward_call(a.trainmem, seq, cp, tp, rank)
            ok = want_b == got_b
            failures += not ok
            print(f"{'ok ' if ok else 'BAD'} {tag} backward: torch peak {want_b:,} B, trainmem {got_b:,} B")
            checks += 2
    print(f"{checks - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
