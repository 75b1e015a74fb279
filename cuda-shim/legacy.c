/*
 * legacy.c - the older ABIs of entry points whose current ABI lives elsewhere.
 *
 * A real driver keeps exporting the ABI each entry point had before it was widened (32-bit sizes
 * and device pointers before CUDA 3.2, cuMemHostRegister before 6.5, cuIpcOpenMemHandle before
 * 11.0), and cuGetProcAddress hands it out to a caller that asks for an old enough version. Each
 * one here is the current ABI with the old argument types, so the fake's bookkeeping (and its
 * call counters) sees the same memory either way.
 */
#include <stdint.h>

#include "internal.h"

/* 32-bit device pointers: the bytes come from cuMemAlloc's low arena, so the address fits. */
FC_API CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int width,
                                unsigned int height, unsigned int elem)
{
    size_t p;
    CUresult rc;

    FC_COUNT(cuMemAllocPitch);
    /* The current ABI's rules (vmm.c): elements of 4, 8 or 16 bytes, rows padded to 512. */
    if (!dptr || !pitch || width == 0 || height == 0 || (elem != 4 && elem != 8 && elem != 16))
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    p = ((size_t)width + 511) & ~(size_t)511;
    if (p * height > 0xffffffffULL)
        return CUDA_ERROR_INVALID_VALUE;
    rc = cuMemAlloc(dptr, (unsigned int)(p * height));
    if (rc == CUDA_SUCCESS)
        *pitch = (unsigned int)p;
    return rc;
}

FC_API CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    CUDA_ARRAY_DESCRIPTOR w;

    FC_COUNT(cuArrayCreate);
    if (!d)
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    w.Width = d->Width;
    w.Height = d->Height;
    w.Format = d->Format;
    w.NumChannels = d->NumChannels;
    return cuArrayCreate_v2(pHandle, &w);
}

FC_API CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    CUDA_ARRAY3D_DESCRIPTOR w;

    FC_COUNT(cuArray3DCreate);
    if (!d)
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    w.Width = d->Width;
    w.Height = d->Height;
    w.Depth = d->Depth;
    w.Format = d->Format;
    w.NumChannels = d->NumChannels;
    w.Flags = d->Flags;
    return cuArray3DCreate_v2(pHandle, &w);
}

FC_API CUresult cuMemAllocHost(void **pp, unsigned int bytesize)
{
    FC_COUNT(cuMemAllocHost);
    return cuMemAllocHost_v2(pp, bytesize);
}

FC_API CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int flags)
{
    FC_COUNT(cuMemHostRegister);
    return cuMemHostRegister_v2(p, bytesize, flags);
}

FC_API CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
    FC_COUNT(cuIpcOpenMemHandle);
    return cuIpcOpenMemHandle_v2(pdptr, handle, flags);
}
