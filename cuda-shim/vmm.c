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

/*
 * Lifetimes as documented: a physical allocation lives until its handle is released (every
 * reference: cuMemCreate gives one, cuMemRetainAllocationHandle one more each) AND every mapping
 * of it is unmapped. A released handle is invalid for new calls even while its memory lives on;
 * cuMemRetainAllocationHandle on a mapped address makes it valid again (same handle value).
 * cuMemUnmap must cover whole mappings: a sub-range of one is refused.
 */
#define VMM_MAGIC 0x564d4d48U
struct vmm {
    unsigned int magic;
    int fd, dev;
    size_t size;
    int refs, maps;             /* g_vmm_lock */
};

struct vmm_map {
    uintptr_t start, end;
    struct vmm *v;
};
static pthread_mutex_t g_vmm_lock = PTHREAD_MUTEX_INITIALIZER;
static struct vmm_map *g_maps;
static size_t g_nmaps, g_capmaps;

/* A handle the caller may still use (lock held). */
static struct vmm *vmm_live(CUmemGenericAllocationHandle handle)
{
    struct vmm *v = (struct vmm *)(uintptr_t)handle;
    return v && v->magic == VMM_MAGIC && v->refs > 0 ? v : NULL;
}

static void vmm_free(struct vmm *v)
{
    v->magic = 0;
    close(v->fd);
    if (v->dev >= 0)
        fc_mem_charge(v->dev, -(long long)v->size);
    free(v);
}

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
    v->refs = 1;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)v;
    return CUDA_SUCCESS;
}

/* Drops one reference; the memory goes only when no reference and no mapping is left. */
FC_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    struct vmm *v;
    int gone;

    FC_COUNT(cuMemRelease);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_vmm_lock);
    if (!(v = vmm_live(handle))) {
        pthread_mutex_unlock(&g_vmm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    gone = --v->refs == 0 && v->maps == 0;
    pthread_mutex_unlock(&g_vmm_lock);
    if (gone)
        vmm_free(v);
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    uintptr_t a = (uintptr_t)addr;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;

    FC_COUNT(cuMemRetainAllocationHandle);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmm_lock);
    for (size_t i = 0; i < g_nmaps; i++)
        if (a >= g_maps[i].start && a < g_maps[i].end) {
            g_maps[i].v->refs++;
            *handle = (CUmemGenericAllocationHandle)(uintptr_t)g_maps[i].v;
            rc = CUDA_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&g_vmm_lock);
    return rc;
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
    uintptr_t s = (uintptr_t)ptr, e = s + size;
    CUresult rc = CUDA_SUCCESS;
    struct vmm *v;

    FC_COUNT(cuMemMap);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_vmm_lock);
    v = vmm_live(handle);
    if (!ptr || !v || flags || size == 0 || offset + size > v->size || e < s)
        rc = CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; rc == CUDA_SUCCESS && i < g_nmaps; i++)
        if (g_maps[i].start < e && s < g_maps[i].end)
            rc = CUDA_ERROR_INVALID_VALUE;       /* already mapped */
    if (rc == CUDA_SUCCESS && g_nmaps == g_capmaps) {
        size_t cap = g_capmaps ? 2 * g_capmaps : 64;
        struct vmm_map *m = realloc(g_maps, cap * sizeof *m);
        if (m) {
            g_maps = m;
            g_capmaps = cap;
        } else {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (rc == CUDA_SUCCESS &&
        mmap((void *)s, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, v->fd, (off_t)offset) == MAP_FAILED)
        rc = CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) {
        g_maps[g_nmaps++] = (struct vmm_map){ s, e, v };
        v->maps++;
    }
    pthread_mutex_unlock(&g_vmm_lock);
    return rc;
}

FC_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    uintptr_t s = (uintptr_t)ptr, e = s + size;
    struct vmm *gone[64];
    size_t ngone = 0, hit = 0, j = 0;
    CUresult rc = CUDA_SUCCESS;

    FC_COUNT(cuMemUnmap);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ptr || size == 0 || e < s)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmm_lock);
    for (size_t i = 0; i < g_nmaps; i++)
        if (g_maps[i].start < e && s < g_maps[i].end) {
            hit++;
            if (g_maps[i].start < s || g_maps[i].end > e)
                rc = CUDA_ERROR_INVALID_VALUE;   /* a sub-range of a mapping */
        }
    if (hit == 0 || hit > 64)
        rc = CUDA_ERROR_INVALID_VALUE;
    /* Back to reserved, inaccessible address space. */
    if (rc == CUDA_SUCCESS &&
        mmap((void *)s, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED)
        rc = CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) {
        for (size_t i = 0; i < g_nmaps; i++) {
            struct vmm_map m = g_maps[i];
            if (m.start < e && s < m.end) {
                if (--m.v->maps == 0 && m.v->refs == 0)
                    gone[ngone++] = m.v;
            } else {
                g_maps[j++] = m;
            }
        }
        g_nmaps = j;
    }
    pthread_mutex_unlock(&g_vmm_lock);
    for (size_t i = 0; i < ngone; i++)
        vmm_free(gone[i]);
    return rc;
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
    struct fc_ctx *ctx;         /* destroyed with this context */
    struct fc_array *prev, *next;
};
static struct fc_array g_arrays = { .prev = &g_arrays, .next = &g_arrays };
static pthread_mutex_t g_array_lock = PTHREAD_MUTEX_INITIALIZER;

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
    a->ctx = c;
    pthread_mutex_lock(&g_array_lock);
    a->next = g_arrays.next;
    a->prev = &g_arrays;
    a->next->prev = a;
    g_arrays.next = a;
    pthread_mutex_unlock(&g_array_lock);
    *out = a;
    return CUDA_SUCCESS;
}

/* Unlinks and frees; g_array_lock held. */
static void array_free(struct fc_array *a)
{
    a->magic = 0;
    a->prev->next = a->next;
    a->next->prev = a->prev;
    fc_mem_charge(a->dev, -(long long)a->bytes);
    free(a);
}

static CUresult array_destroy(struct fc_array *a)
{
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_array_lock);
    if (a && a->magic == ARRAY_MAGIC) {
        array_free(a);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_array_lock);
    return rc;
}

/* Arrays are freed with the context they were made in (cuCtxDestroy's documentation). */
void fc_arrays_ctx_gone(struct fc_ctx *c)
{
    struct fc_array *a, *next;

    pthread_mutex_lock(&g_array_lock);
    for (a = g_arrays.next; a != &g_arrays; a = next) {
        next = a->next;
        if (a->ctx == c)
            array_free(a);
    }
    pthread_mutex_unlock(&g_array_lock);
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
