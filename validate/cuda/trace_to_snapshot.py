#!/usr/bin/env python3
"""Turn a measured run (a trainmem-measurement-v1 JSON of validate/cuda/measure.py) back into the
torch.cuda.memory._snapshot() pickle it was read from, as far as the file keeps it.

measure.py kept, of the snapshot, the device trace's alloc / free_completed / segment_* entries as
[action, size, address(, stream)] and the segments as [address, size, pool]; the pickle itself was not kept.
This writes those entries back in the snapshot's layout (torch/csrc/cuda/Module.cpp, 2.x): each
free_completed preceded by its free_requested (the allocator records both when no other stream holds the
block), "frames" empty (the file has no stacks), and the segments' blocks rebuilt from the trace: the blocks
still allocated at the end at their addresses, each as large as its request rounded up to 512 bytes (the
allocator's smallest rounding; a block it did not split can be larger, which the trace does not record), the
rest of each segment "inactive". `trainmem diff` reads only the device trace.

    /usr/bin/python3 validate/cuda/trace_to_snapshot.py validate/measured/<run>.json /tmp/run.pickle
"""

import argparse
import json
import pickle
import sys


def convert(measurement):
    trace = measurement.get("trace") or {}
    if "events" not in trace:
        raise SystemExit("the measurement holds no allocator trace")
    names = {int(k): v for k, v in trace["actions"].items()}
    empty_frames = []  # one list for every entry, as the snapshot's py::list empty_frames
    entries, live = [], {}
    for t, event in enumerate(trace["events"]):
        action = names[event[0]]
        size, addr = int(event[1]), int(event[2])
        stream = int(event[3]) if len(event) > 3 else 0
        entry = {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t,
                 "frames": empty_frames}
        if action == "free_completed":
            entries.append(dict(entry, action="free_requested"))
            live.pop(addr, None)
        elif action == "alloc":
            live[addr] = size
        elif action == "oom":
            entry["device_free"] = entry.pop("addr")
        entries.append(entry)
    segments = []
    for address, total, pool in sorted(measurement.get("segments") or []):
        blocks, at = [], address
        for addr in sorted(a for a in live if address <= a < address + total):
            if addr > at:
                blocks.append({"address": at, "size": addr - at, "requested_size": 0, "state": "inactive",
                               "frames": empty_frames})
            size = min(-(-live[addr] // 512) * 512, address + total - addr)
            blocks.append({"address": addr, "size": size, "requested_size": live[addr], "state": "active_allocated",
                           "frames": empty_frames})
            at = addr + size
        if at < address + total:
            blocks.append({"address": at, "size": address + total - at, "requested_size": 0, "state": "inactive",
                           "frames": empty_frames})
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        segments.append({"device": 0, "address": address, "total_size": total, "allocated_size": allocated,
                         "active_size": allocated,
                         "requested_size": sum(b["requested_size"] for b in blocks), "stream": 0,
                         "segment_type": pool or "large", "segment_pool_id": (0, 0), "is_expandable": False,
                         "frames": empty_frames, "blocks": blocks})
    return {"segments": segments, "device_traces": [entries]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("measurement")
    ap.add_argument("out")
    ap.add_argument("--protocol", type=int, default=pickle.DEFAULT_PROTOCOL,
                    help="pickle protocol (default: this Python's, as pickle.dump(torch.cuda.memory._snapshot()))")
    args = ap.parse_args(argv)
    with open(args.measurement) as f:
        measurement = json.load(f)
    with open(args.out, "wb") as f:
        pickle.dump(convert(measurement), f, protocol=args.protocol)
    return 0


if __name__ == "__main__":
    sys.exit(main())
