"""NVIDIA's cuda-bindings (cuda.bindings.driver) under the preload on the fake driver.

It resolves the driver as the CUDA runtime does (dlopen + cuGetProcAddress_v2), so it proves the
lookup paths on code we did not write. Exits non-zero with a message on the first wrong answer.
Run by tests/bindings.rs with VRAMCAP_LIMIT=64m."""
import sys

from cuda.bindings import driver as d

MIB = 1 << 20
OK, OOM = d.CUresult.CUDA_SUCCESS, d.CUresult.CUDA_ERROR_OUT_OF_MEMORY


def check(what, got, want):
    if got != want:
        sys.exit(f"bindings: {what}: got {got}, want {want}")


def used():
    err, free, total = d.cuMemGetInfo()
    check("cuMemGetInfo", err, OK)
    check("cuMemGetInfo total", total, 64 * MIB)
    return total - free


check("cuInit", d.cuInit(0)[0], OK)
err, dev = d.cuDeviceGet(0)
err, ctx = d.cuDevicePrimaryCtxRetain(dev)
check("retain", err, OK)
check("set current", d.cuCtxSetCurrent(ctx)[0], OK)

# cuMemAlloc: over the cap is refused.
err, a = d.cuMemAlloc(48 * MIB)
check("cuMemAlloc 48m", err, OK)
check("cuMemAlloc over cap", d.cuMemAlloc(32 * MIB)[0], OOM)
check("used after cuMemAlloc", used(), 48 * MIB)
check("cuMemFree", d.cuMemFree(a)[0], OK)

# Stream-ordered: the pool's reserved bytes are charged until a synchronize gives them back.
stream = d.CUstream(0)
err, p = d.cuMemAllocAsync(40 * MIB, stream)
check("cuMemAllocAsync", err, OK)
check("cuMemAllocAsync over cap", d.cuMemAllocAsync(30 * MIB, stream)[0], OOM)
check("cuMemFreeAsync", d.cuMemFreeAsync(p, stream)[0], OK)
check("cuStreamSynchronize", d.cuStreamSynchronize(stream)[0], OK)
check("used after async free + sync", used(), 0)

# VMM: cuMemCreate is charged, mapping is not.
prop = d.CUmemAllocationProp()
prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
err, gran = d.cuMemGetAllocationGranularity(prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
check("granularity", err, OK)
err, h = d.cuMemCreate(48 * MIB, prop, 0)
check("cuMemCreate", err, OK)
check("cuMemCreate over cap", d.cuMemCreate(32 * MIB, prop, 0)[0], OOM)
err, va = d.cuMemAddressReserve(48 * MIB, 0, 0, 0)
check("cuMemAddressReserve", err, OK)
check("cuMemMap", d.cuMemMap(va, 48 * MIB, 0, h, 0)[0], OK)
check("used with a mapping", used(), 48 * MIB)
check("cuMemUnmap", d.cuMemUnmap(va, 48 * MIB)[0], OK)
check("cuMemAddressFree", d.cuMemAddressFree(va, 48 * MIB)[0], OK)
check("cuMemRelease", d.cuMemRelease(h)[0], OK)

check("usage back to zero", used(), 0)
print("bindings ok")
