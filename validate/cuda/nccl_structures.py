"""What one NCCL communicator costs the GPU outside PyTorch's caching allocator, on one GPU.

A communicator of one rank connects to no peer (no ring, tree, NVLS or P2P buffers), so what its first collective
takes from cudaMemGetInfo is the per-communicator device structures (init.cc devCommSetup, channel.cc initChannel
on every initialised channel) and whatever NCCL loads (its kernels' code). trainmem's rule (include/trainmem/nccl.h):
each structure is its own ncclCudaCallocAsync, which under cuMem (NCCL_CUMEM_ENABLE default) is a cuMemCreate
aligned to the device's minimum granularity (alloc.h ncclCuMemAlloc), 2 MiB. The run compares cuMem on and off:
the difference is what the granularity costs, to set against (number of 'Cuda Alloc Size' lines) x (2 MiB - size).

Usage (one GPU): python3 validate/cuda/nccl_structures.py OUT_DIR [cumem 0|1]
Writes OUT_DIR/nccl_cumem<0|1>.json and the NCCL_DEBUG=INFO log beside it.
"""
import json
import os
import re
import sys


def granularity():
    try:
        from cuda.bindings import driver
    except ImportError:
        return {}
    driver.cuInit(0)
    out = {}
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    for name in ("CU_MEM_ALLOC_GRANULARITY_MINIMUM", "CU_MEM_ALLOC_GRANULARITY_RECOMMENDED"):
        err, g = driver.cuMemGetAllocationGranularity(prop, getattr(driver.CUmemAllocationGranularity_flags, name))
        out[name] = int(g) if int(err) == 0 else f"error {err}"
    err, dev = driver.cuDeviceGet(0)
    err, mc = driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, dev)
    out["CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED"] = int(mc) if int(err) == 0 else f"error {err}"
    return out


def main():
    out_dir, cumem = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "1"
    log = os.path.join(out_dir, f"nccl_cumem{cumem}.log")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + int(cumem)), NCCL_DEBUG="INFO",
                      NCCL_DEBUG_SUBSYS="INIT,ALLOC", NCCL_DEBUG_FILE=log, NCCL_CUMEM_ENABLE=cumem)
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    dist.all_reduce(x)  # the communicator is created here (lazy init)
    torch.cuda.synchronize()
    free2, _ = torch.cuda.mem_get_info()
    dist.all_reduce(x)
    torch.cuda.synchronize()
    free3, _ = torch.cuda.mem_get_info()
    dist.destroy_process_group()
    text = open(log).read() if os.path.exists(log) else ""
    allocs = [int(m) for m in re.findall(r"Cuda Alloc Size (\d+)", text)]
    channels = re.findall(r"(\d+) coll channels, (\d+) collnet channels, (\d+) nvls channels, (\d+) p2p channels, "
                          r"(\d+) p2p channels per peer", text)
    result = {
        "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "gpu": torch.cuda.get_device_name(0), "cumem": cumem, "granularity": granularity(),
        "init_process_group_bytes": free0 - free1, "first_collective_bytes": free1 - free2,
        "second_collective_bytes": free2 - free3, "reserved_bytes": torch.cuda.memory_reserved(),
        "cuda_alloc_sizes": allocs, "cuda_alloc_count": len(allocs), "channels_line": channels,
    }
    with open(os.path.join(out_dir, f"nccl_cumem{cumem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "cuda_alloc_sizes"}))


if __name__ == "__main__":
    main()
