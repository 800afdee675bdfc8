#!/usr/bin/env python3
"""Turns seed 000's published PyTorch memory trace into validate/measured/seed000_trace.json.

Seed 000 ("Transformer Memory Arithmetic: Understanding all the Bytes in nanoGPT", Edward Rees, 2023) links its
torch.cuda.memory snapshots; they are in the author's site repository erees1/erees1.github.io under
assets/img/blog/transformer-memory/ (mem_post_bwd-step2-flashFalse_trace.html, commit
cd24300f5548e1c667ecfbda5754f6b7858f1380). The HTML embeds the trace as `let alloc_data = {...}` (the format of
torch/cuda/_memory_viz.py in 2023): `actions` lists element ids, the first occurrence of an id is its
allocation and the second its free; `elements` holds the requested size and an index into the frame tables.

Usage: extract.py TRACE.html > validate/measured/seed000_trace.json
"""
import json
import sys


def main(path):
    text = open(path).read()
    start = text.index("let alloc_data = ") + len("let alloc_data = ")
    depth = 0
    for k, ch in enumerate(text[start:]):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                end = start + k + 1
                break
    data = json.loads(text[start:end])
    st, sfx = data["string_table"], data["suffix_table"]

    def frames(info):
        out = []
        while info is not None:
            s, info = sfx[info]
            out.append(st[s])
        return out

    def short(frame):
        frame = frame.replace("/home/edwardr/git/nanoGPT/", "")
        if "site-packages" in frame:
            frame = "/".join(frame.split("/")[-2:])
        return frame

    elements = data["elements"]
    out = {
        "source": "seed 000 (Edward Rees, 'Transformer Memory Arithmetic: Understanding all the Bytes in nanoGPT', "
                  "2023): torch.cuda memory trace mem_post_bwd-step2-flashFalse_trace.html from "
                  "github.com/erees1/erees1.github.io assets/img/blog/transformer-memory/ at commit "
                  "cd24300f5548e1c667ecfbda5754f6b7858f1380",
        "setup": "nanoGPT fork, GPT-2 small (12 layers, 12 heads, 768 wide, vocab 50304, no biases), batch 12, "
                 "seq 1024, float16 autocast with GradScaler (the trace shows GradScaler.scale allocating), fused "
                 "AdamW, no flash attention, A100, PyTorch 2.0-era (torch/nn/modules/module.py:1501:_call_impl)",
        "measured": {
            "max_memory_allocated_gib": 21.898,
            "steady_state_memory_allocated_bytes": 2064403456,
            "steady_state_gap_bytes": 6855368,
            "activations_snapshot_gib": 17.673,
            "after_forward_memory_allocated_bytes": 21040721408,
            "after_forward_gap_bytes": 6855876,
            "steady_state_reserved_bytes": 23437770752,
            "after_forward_step3_reserved_bytes": 25910312960,
            "nvidia_smi_context_mib": 863,
        },
        "events": [],
        "frames": {},
    }
    seen = set()
    for a in data["actions"]:
        e = elements[a]
        out["events"].append([a, e["size"]])
        if a not in seen:
            seen.add(a)
            fr = [short(f) for f in frames(e["info"])][:3]
            out["frames"][str(a)] = " | ".join(f for f in fr if not f.endswith("allocation"))
    json.dump(out, sys.stdout, separators=(",", ":"))


if __name__ == "__main__":
    main(sys.argv[1])
