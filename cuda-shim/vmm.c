/*
 * vmm.c - the other ways to get memory from the fake driver: pitched
 * allocations (managed memory: managed.c), virtual memory management (cuMemCreate/cuMemMap...)
 * with POSIX file-descriptor shareable handles, page-locked host memory and
 * IPC (arrays: arrays.c).
 *
 * VMM is real here: a physical allocation is a memfd of the requested size,
 * cuMemAddressReserve reserves PROT_NONE address space and cuMemMap maps the
 * memfd into it, so a test can write through a mapped address.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
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

/* ---------------------------------------------------------------- VMM */

/*
 * Lifetimes as documented: a physical allocation lives until its handle is released (every
 * reference: cuMemCreate gives one, cuMemRetainAllocationHandle one more each) AND every mapping
 * of it is unmapped. A released handle is invalid for new calls even while its memory lives on;
 * cuMemRetainAllocationHandle on a mapped address makes it valid again (same handle value).
 * cuMemUnmap must cover whole mappings: a sub-range of one is refused.
 *
 * Shareable handles (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR only, for allocations created with
 * that type in prop->requestedHandleTypes, as documented): the exported fd is a duplicate of the
 * allocation's memfd. The documentation counts a shareable handle among the references that keep
 * the memory alive, and an fd may live on in any process it was sent to, where this driver cannot
 * see it close: an exported allocation's memory is never given back (for the life of the
 * process). cuMemImportFromShareableHandle of such an fd in this process answers the same handle
 * value with one more reference (valid again if it had been released).
 */
#define VMM_MAGIC 0x564d4d48U
struct vmm {
    unsigned int magic;
    int fd, dev;
    int type_mask;              /* prop->requestedHandleTypes */
    size_t size;
    int refs, maps;             /* g_vmm_lock */
    int exported;               /* g_vmm_lock: a shareable handle exists, never freed */
    struct vmm *next_exported;  /* g_vmm_lock: g_exported list */
};

struct vmm_map {
    uintptr_t start, end;
    struct vmm *v;
};
static pthread_mutex_t g_vmm_lock = PTHREAD_MUTEX_INITIALIZER;
static struct vmm_map *g_maps;
static size_t g_nmaps, g_capmaps;
static struct vmm *g_exported;  /* every exported allocation (import looks them up) */

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
    /* Host locations are host memory: not charged to any device; a locality domain is its
     * device's memory; any other type names no memory. */
    if ((rc = fc_location_dev(&prop->location, &dev)) != 0)
        return rc;
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
    v->type_mask = prop->requestedHandleTypes;
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
    gone = --v->refs == 0 && v->maps == 0 && !v->exported;
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
                if (--m.v->maps == 0 && m.v->refs == 0 && !m.v->exported)
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

FC_API CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                             int handleType, unsigned long long flags)
{
    CUresult rc = CUDA_SUCCESS;
    struct vmm *v;
    int fd = -1;

    FC_COUNT(cuMemExportToShareableHandle);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!shareableHandle || flags)
        return CUDA_ERROR_INVALID_VALUE;
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&g_vmm_lock);
    v = vmm_live(handle);
    if (!v || !(v->type_mask & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        rc = CUDA_ERROR_INVALID_VALUE;      /* not created with this handle type */
    else if ((fd = fcntl(v->fd, F_DUPFD_CLOEXEC, 0)) < 0)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (rc == CUDA_SUCCESS) {
        if (!v->exported) {
            v->exported = 1;
            v->next_exported = g_exported;
            g_exported = v;
        }
        *(int *)shareableHandle = fd;
    }
    pthread_mutex_unlock(&g_vmm_lock);
    return rc;
}

/* Only fds exported by this process are known; another process's memory is not modelled. */
FC_API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle, int type)
{
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    struct stat st;

    FC_COUNT(cuMemImportFromShareableHandle);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (fstat((int)(intptr_t)osHandle, &st) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmm_lock);
    for (struct vmm *v = g_exported; v; v = v->next_exported) {
        struct stat mine;
        if (fstat(v->fd, &mine) == 0 && mine.st_dev == st.st_dev && mine.st_ino == st.st_ino) {
            v->refs++;
            *handle = (CUmemGenericAllocationHandle)(uintptr_t)v;
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&g_vmm_lock);
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
