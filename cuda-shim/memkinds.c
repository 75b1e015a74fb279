/*
 * memkinds.c - the other ways to get memory from the fake driver: pitched allocations,
 * page-locked host memory, IPC, and mappings into sparse arrays (VMM: vmm.c; managed memory:
 * managed.c; arrays: arrays.c).
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define PITCH_ALIGN 512

FC_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                   unsigned int elem)
{
    size_t p;
    CUresult rc;

    FC_COUNT(cuMemAllocPitch_v2);
    if (!pitch || width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16))
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    p = (width + PITCH_ALIGN - 1) & ~(size_t)(PITCH_ALIGN - 1);
    rc = fc_mem_alloc_cur(dptr, p * height);
    if (rc == CUDA_SUCCESS)
        *pitch = p;
    return rc;
}

/* ------------------------------------------------------- host memory, IPC */

static CUresult host_alloc(void **pp, size_t bytesize)
{
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pp || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return (*pp = aligned_alloc(4096, (bytesize + 4095) & ~(size_t)4095)) ? CUDA_SUCCESS
                                                                          : CUDA_ERROR_OUT_OF_MEMORY;
}

FC_API CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int flags)
{
    (void)flags;
    FC_COUNT(cuMemHostAlloc);
    return host_alloc(pp, bytesize);
}

FC_API CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    FC_COUNT(cuMemAllocHost_v2);
    return host_alloc(pp, bytesize);
}

FC_API CUresult cuMemFreeHost(void *p)
{
    FC_COUNT(cuMemFreeHost);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    free(p);
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int flags)
{
    (void)flags;
    FC_COUNT(cuMemHostRegister_v2);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    return p && bytesize ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_API CUresult cuMemHostUnregister(void *p)
{
    FC_COUNT(cuMemHostUnregister);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* The fake's IPC handle carries the exporting process's pointer in its first
 * 8 bytes (same address space in tests). */
FC_API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
    CUdeviceptr p;

    (void)flags;
    FC_COUNT(cuIpcOpenMemHandle_v2);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    memcpy(&p, handle.reserved, sizeof p);
    if (!pdptr || !p)
        return CUDA_ERROR_INVALID_VALUE;
    *pdptr = p;
    return CUDA_SUCCESS;
}

FC_API CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    FC_COUNT(cuIpcCloseMemHandle);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    return dptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/*
 * Sparse and mipmapped arrays are not modelled: the fake device has no sparse array support
 * (CU_DEVICE_ATTRIBUTE_SPARSE_CUDA_ARRAY_SUPPORTED is 0), so mapping into one is not supported,
 * as a real device without that support answers.
 */
static CUresult map_array_async(void *mapInfoList, unsigned int count, CUstream hStream)
{
    (void)mapInfoList;
    (void)count;
    (void)hStream;
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_ERROR_NOT_SUPPORTED;
}

FC_API CUresult cuMemMapArrayAsync(void *mapInfoList, unsigned int count, CUstream hStream)
{
    FC_COUNT(cuMemMapArrayAsync);
    return map_array_async(mapInfoList, count, hStream);
}

FC_API CUresult cuMemMapArrayAsync_ptsz(void *mapInfoList, unsigned int count, CUstream hStream)
{
    FC_COUNT(cuMemMapArrayAsync_ptsz);
    return map_array_async(mapInfoList, count, hStream);
}
