/*
 * vmm.c - the other ways to get memory from the fake driver: pitched and
 * managed allocations, virtual memory management (cuMemCreate/cuMemMap...),
 * CUDA arrays, page-locked host memory and IPC.
 *
 * VMM is real here: a physical allocation is a memfd of the requested size,
 * cuMemAddressReserve reserves PROT_NONE address space and cuMemMap maps the
 * memfd into it, so a test can write through a mapped address.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

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

/* Managed memory lives on the device it was allocated from (no migration). */
FC_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    FC_COUNT(cuMemAllocManaged);
    if (flags != 1 && flags != 2)       /* CU_MEM_ATTACH_GLOBAL / _HOST */
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return fc_mem_alloc_cur(dptr, bytesize);
}

/* ---------------------------------------------------------------- VMM */

#define VMM_MAGIC 0x564d4d48U
struct vmm {
    unsigned int magic;
    int fd, dev;
    size_t size;
};

FC_API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                              int option)
{
    (void)option;
    FC_COUNT(cuMemGetAllocationGranularity);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!granularity || !prop)
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = FC_GRANULARITY;
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                            const CUmemAllocationProp *prop, unsigned long long flags)
{
    struct vmm *v;
    int dev;
    CUresult rc;

    FC_COUNT(cuMemCreate);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!handle || !prop || flags || size == 0 || size % FC_GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    /* Host locations are host memory: not charged to any device. */
    dev = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop->location.id : -1;
    if (dev >= 0 && !valid_dev(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    if ((rc = fc_mem_inject()) != 0)
        return rc;
    if (!(v = calloc(1, sizeof *v)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (dev >= 0 && fc_mem_charge(dev, (long long)size) != 0) {
        free(v);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    v->fd = memfd_create("fakecuda-vmm", MFD_CLOEXEC);
    if (v->fd < 0 || ftruncate(v->fd, (off_t)size) != 0) {
        if (v->fd >= 0)
            close(v->fd);
        if (dev >= 0)
            fc_mem_charge(dev, -(long long)size);
        free(v);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    v->magic = VMM_MAGIC;
    v->dev = dev;
    v->size = size;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)v;
    return CUDA_SUCCESS;
}

/* Mappings hold the memfd's pages themselves, so releasing a mapped handle
 * is safe (as in the real driver, the memory lives until unmapped). */
FC_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    struct vmm *v = (struct vmm *)(uintptr_t)handle;

    FC_COUNT(cuMemRelease);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!v || v->magic != VMM_MAGIC)
        return CUDA_ERROR_INVALID_VALUE;
    v->magic = 0;
    close(v->fd);
    if (v->dev >= 0)
        fc_mem_charge(v->dev, -(long long)v->size);
    free(v);
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags)
{
    void *p;

    (void)alignment;
    FC_COUNT(cuMemAddressReserve);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ptr || size == 0 || size % FC_GRANULARITY || flags)
        return CUDA_ERROR_INVALID_VALUE;
    p = mmap((void *)(uintptr_t)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    FC_COUNT(cuMemAddressFree);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return munmap((void *)(uintptr_t)ptr, size) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FC_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags)
{
    struct vmm *v = (struct vmm *)(uintptr_t)handle;

    FC_COUNT(cuMemMap);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ptr || !v || v->magic != VMM_MAGIC || flags || size == 0 || offset + size > v->size)
        return CUDA_ERROR_INVALID_VALUE;
    if (mmap((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, v->fd,
             (off_t)offset) == MAP_FAILED)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    FC_COUNT(cuMemUnmap);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    /* Back to reserved, inaccessible address space. */
    if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
             -1, 0) == MAP_FAILED)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    FC_COUNT(cuMemSetAccess);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    return ptr && size && desc && count ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* No shareable handles exist in the fake. */
FC_API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle, int type)
{
    (void)osHandle;
    (void)type;
    FC_COUNT(cuMemImportFromShareableHandle);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    return handle ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE;
}

/* -------------------------------------------------------------- arrays */

#define ARRAY_MAGIC 0x41525259U
struct fc_array {
    unsigned int magic;
    int dev;
    size_t bytes;
};

static size_t format_bytes(int f)
{
    switch (f) {
    case 0x01: case 0x08: return 1;
    case 0x02: case 0x09: case 0x10: return 2;
    case 0x03: case 0x0a: case 0x20: return 4;
    default: return 0;
    }
}

static size_t dim(size_t v)
{
    return v ? v : 1;
}

static CUresult array_new(struct fc_array **out, size_t bytes)
{
    struct fc_ctx *c;
    struct fc_array *a;
    CUresult rc;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!(c = fc_current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = fc_mem_inject()) != 0)
        return rc;
    if (!(a = calloc(1, sizeof *a)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (fc_mem_charge(c->dev, (long long)bytes) != 0) {
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->magic = ARRAY_MAGIC;
    a->dev = c->dev;
    a->bytes = bytes;
    *out = a;
    return CUDA_SUCCESS;
}

static CUresult array_destroy(struct fc_array *a)
{
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!a || a->magic != ARRAY_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    a->magic = 0;
    fc_mem_charge(a->dev, -(long long)a->bytes);
    free(a);
    return CUDA_SUCCESS;
}

FC_API CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    FC_COUNT(cuArrayCreate_v2);
    if (!pHandle || !d || !format_bytes(d->Format) || d->Width == 0)
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return array_new(pHandle, d->Width * dim(d->Height) * format_bytes(d->Format) * d->NumChannels);
}

FC_API CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    FC_COUNT(cuArray3DCreate_v2);
    if (!pHandle || !d || !format_bytes(d->Format) || d->Width == 0)
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return array_new(pHandle, d->Width * dim(d->Height) * dim(d->Depth) * format_bytes(d->Format) *
                                  d->NumChannels);
}

FC_API CUresult cuArrayDestroy(CUarray hArray)
{
    FC_COUNT(cuArrayDestroy);
    return array_destroy(hArray);
}

FC_API CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                       unsigned int levels)
{
    size_t bytes = 0;

    FC_COUNT(cuMipmappedArrayCreate);
    if (!pHandle || !d || !format_bytes(d->Format) || d->Width == 0 || levels == 0)
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    for (unsigned int l = 0; l < levels; l++) {
        size_t w = dim(d->Width >> l), h = d->Height ? dim(d->Height >> l) : 1,
               z = d->Depth ? dim(d->Depth >> l) : 1;
        bytes += w * h * z * format_bytes(d->Format) * d->NumChannels;
    }
    return array_new(pHandle, bytes);
}

FC_API CUresult cuMipmappedArrayDestroy(CUmipmappedArray h)
{
    FC_COUNT(cuMipmappedArrayDestroy);
    return array_destroy(h);
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
