"""Context and VMM lifetimes through NVIDIA's cuda-bindings 13 (its cuCtxCreate is the _v4 ABI,
fetched with cuGetProcAddress), on the fake driver that keeps the documented rules.
Run by tests/bindings.rs with VRAMCAP_LIMIT=64m. Exits non-zero on the first wrong answer."""
import sys

from cuda.bindings import driver as d

MIB = 1 << 20
OK, OOM = d.CUresult.CUDA_SUCCESS, d.CUresult.CUDA_ERROR_OUT_OF_MEMORY


def check(what, got, want):
    if got != want:
        sys.exit(f"bindings lifetimes: {what}: got {got}, want {want}")


check("cuInit", d.cuInit(0)[0], OK)
err, dev = d.cuDeviceGet(0)


def primary():
    err, ctx = d.cuDevicePrimaryCtxRetain(dev)
    check("retain", err, OK)
    check("set current", d.cuCtxSetCurrent(ctx)[0], OK)


# The report: alloc, release the (last) primary reference, retain, alloc again.
primary()
check("alloc 48m", d.cuMemAlloc(48 * MIB)[0], OK)
check("release", d.cuDevicePrimaryCtxRelease(dev)[0], OK)
primary()
check("alloc 48m after the primary context was reset by its last release", d.cuMemAlloc(48 * MIB)[0], OK)
check("release", d.cuDevicePrimaryCtxRelease(dev)[0], OK)

# A created context frees its own memory when destroyed, not a cuMemCreate handle.
prop = d.CUmemAllocationProp()
prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
err, ctx = d.cuCtxCreate(None, 0, dev)
check("cuCtxCreate (v4)", err, OK)
check("alloc 32m", d.cuMemAlloc(32 * MIB)[0], OK)
err, h = d.cuMemCreate(32 * MIB, prop, 0)
check("cuMemCreate 32m", err, OK)
check("cuCtxDestroy", d.cuCtxDestroy(ctx)[0], OK)
primary()
check("the handle outlives its context", d.cuMemAlloc(48 * MIB)[0], OOM)
check("alloc 32m", d.cuMemAlloc(32 * MIB)[0], OK)

# Released right after mapping, as NVIDIA's VMM samples do: still there until unmapped.
err, va = d.cuMemAddressReserve(32 * MIB, 0, 0, 0)
check("reserve", err, OK)
check("map", d.cuMemMap(va, 32 * MIB, 0, h, 0)[0], OK)
check("release while mapped", d.cuMemRelease(h)[0], OK)
check("cuMemCreate while the released handle is mapped", d.cuMemCreate(2 * MIB, prop, 0)[0], OOM)
err, h2 = d.cuMemRetainAllocationHandle(va)
check("cuMemRetainAllocationHandle", err, OK)
check("the same handle", int(h2), int(h))
check("unmap", d.cuMemUnmap(va, 32 * MIB)[0], OK)
check("cuMemCreate while the retained handle lives", d.cuMemCreate(2 * MIB, prop, 0)[0], OOM)
check("release the retained reference", d.cuMemRelease(h2)[0], OK)
err, h3 = d.cuMemCreate(32 * MIB, prop, 0)
check("cuMemCreate once released and unmapped", err, OK)
check("release", d.cuMemRelease(h3)[0], OK)

# PyCUDA's way: a created (and attached) context ends at its last cuCtxDetach.
err, ctx = d.cuCtxCreate(None, 0, dev)
check("cuCtxCreate", err, OK)
err, same = d.cuCtxAttach(0)
check("cuCtxAttach", (err, int(same)), (OK, int(ctx)))
# The primary context still holds 32m: 16m here, then 20m more is past the 64m cap.
err, a = d.cuMemAlloc(16 * MIB)
check("alloc 16m in the attached context", err, OK)
check("detach (count 2 -> 1)", d.cuCtxDetach(ctx)[0], OK)
check("push", d.cuCtxPushCurrent(ctx)[0], OK)
check("still alive: its 16m still held", d.cuMemAlloc(20 * MIB)[0], OOM)
check("detach (count 1 -> 0: destroyed)", d.cuCtxDetach(ctx)[0], OK)
primary()
check("alloc 30m once the detached context is gone", d.cuMemAlloc(30 * MIB)[0], OK)
print("bindings lifetimes ok")
