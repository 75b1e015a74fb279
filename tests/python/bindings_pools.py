"""NVIDIA's cuda-bindings under the preload on the fake driver: stream-ordered and graph memory
lifetimes (issue 14) from a real third-party client. Run by tests/lifetimes_pool.rs with
VRAMCAP_LIMIT=256m. Exits non-zero with a message on the first wrong answer."""
import sys
import threading

from cuda.bindings import driver as d

MIB = 1 << 20
OK, OOM = d.CUresult.CUDA_SUCCESS, d.CUresult.CUDA_ERROR_OUT_OF_MEMORY


def check(what, got, want):
    if got != want:
        sys.exit(f"bindings: {what}: got {got}, want {want}")


def used():
    err, free, total = d.cuMemGetInfo()
    check("cuMemGetInfo", err, OK)
    return total - free


def pool_on(dev):
    props = d.CUmemPoolProps()
    props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    props.location.id = dev
    err, pool = d.cuMemPoolCreate(props)
    check("cuMemPoolCreate", err, OK)
    return pool


check("cuInit", d.cuInit(0)[0], OK)
err, dev = d.cuDeviceGet(0)
err, ctx = d.cuDevicePrimaryCtxRetain(dev)
check("set current", d.cuCtxSetCurrent(ctx)[0], OK)
null = d.CUstream(0)

# A pool destroyed with a live allocation keeps its memory until that allocation is freed.
pool = pool_on(0)
err, p = d.cuMemAllocFromPoolAsync(200 * MIB, pool, null)
check("alloc from pool", err, OK)
check("cuMemPoolDestroy", d.cuMemPoolDestroy(pool)[0], OK)
check("used after destroy", used(), 200 * MIB)
second = pool_on(0)
check("second pool while the first lives", d.cuMemAllocFromPoolAsync(200 * MIB, second, null)[0], OOM)
check("free after destroy", d.cuMemFreeAsync(p, null)[0], OK)
check("used after the last free", used(), 0)
check("destroy second", d.cuMemPoolDestroy(second)[0], OK)

# A thread with no current context allocating on device 0's stream is charged.
err, stream = d.cuStreamCreate(0)
check("cuStreamCreate", err, OK)
results = []
ptrs = []


def no_context():
    err, cur = d.cuCtxGetCurrent()
    results.append(("no context", int(cur) if cur is not None else 0))
    for _ in range(5):
        err, ptr = d.cuMemAllocAsync(100 * MIB, stream)
        results.append(("alloc", err))
        if err == OK:
            ptrs.append(ptr)


t = threading.Thread(target=no_context)
t.start()
t.join()
check("thread premise", results[0], ("no context", 0))
check("no-context allocations", [r for _, r in results[1:]], [OK, OK, OOM, OOM, OOM])
check("used by the thread", used(), 200 * MIB)

# Graph memory is allocated at launch: a launch past the cap is refused with the driver's code.
err, graph = d.cuGraphCreate(0)
check("cuGraphCreate", err, OK)
params = d.CUDA_MEM_ALLOC_NODE_PARAMS()
params.poolProps.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
params.poolProps.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
params.poolProps.location.id = 0
params.bytesize = 100 * MIB
err, node = d.cuGraphAddMemAllocNode(graph, None, 0, params)
check("cuGraphAddMemAllocNode", err, OK)
check("cuGraphAddMemFreeNode", d.cuGraphAddMemFreeNode(graph, [node], 1, params.dptr)[0], OK)
err, exe = d.cuGraphInstantiate(graph, 0)
check("cuGraphInstantiate", err, OK)
check("used after instantiate", used(), 200 * MIB)
check("launch past the cap", d.cuGraphLaunch(exe, null)[0], OOM)
for ptr in ptrs:
    check("free", d.cuMemFreeAsync(ptr, stream)[0], OK)
check("sync", d.cuCtxSynchronize()[0], OK)
check("used after sync", used(), 0)
check("launch", d.cuGraphLaunch(exe, null)[0], OK)
check("used after launch", used(), 100 * MIB)
attr = d.CUgraphMem_attribute.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT
err, reserved = d.cuDeviceGetGraphMemAttribute(dev, attr)
check("graph reserved", (err, int(reserved)), (OK, 100 * MIB))
check("cuDeviceGraphMemTrim", d.cuDeviceGraphMemTrim(dev)[0], OK)
check("used after trim", used(), 0)

print("bindings pools ok")
