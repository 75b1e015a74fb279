/*
 * vmm.c - virtual memory management of the fake driver (cuMemCreate/cuMemMap...) with POSIX
 * file-descriptor shareable handles (pitched, host memory, IPC: memkinds.c; managed memory:
 * managed.c; arrays: arrays.c).
 *
 * VMM is real here: a physical allocation is a memfd of the requested size,
 * cuMemAddressReserve reserves PROT_NONE address space and cuMemMap maps the
 * memfd into it, so a test can write through a mapped address.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

/* ---------------------------------------------------------------- VMM */

/*
 * Lifetimes as documented: a physical allocation lives until its handle is released (every
 * reference: cuMemCreate gives one, cuMemRetainAllocationHandle one more each) AND every mapping
 * of it is unmapped. A released handle is invalid for new calls even while its memory lives on;
 * cuMemRetainAllocationHandle on a mapped address makes it valid again (same handle value).
 * cuMemUnmap must cover whole mappings: a sub-range of one is refused.
 *
 * Shareable handles (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR only, for allocations created with
 * that type in prop->requestedHandleTypes, as documented). The documentation counts a shareable
 * handle among the references that keep the memory alive ("including its shareable
 * counterparts"), and each import is one more reference, released by cuMemRelease: the memory goes
 * when no process holds a reference or a mapping AND no exported fd is open anywhere. Modelled
 * across processes without a daemon, with open file description (OFD) locks on the memfd, which
 * the kernel drops when the last fd of a description closes, in whatever process:
 *  - an exported fd is a new description of the memfd holding a read lock on byte LK_FD;
 *  - each process's allocation (the exporter's, and one per importing process, on a description
 *    of its own) holds a read lock on byte LK_HOLDER while it has references or mappings;
 *  - a process whose allocation ends drops its LK_HOLDER lock and, serialized with the others by
 *    a write lock on LK_SERIAL, looks for anyone else's: holders left, it only stops counting the
 *    memory in its own view; none and no fd, it frees the memory (on the device counters shared
 *    by processes too, FAKECUDA_SHARED_DEVICE); none but an fd open, the allocation waits
 *    ("pending") and is looked at again at cuMemCreate, cuMemGetInfo and fakecuda_stats.
 * An importer finds the size (the memfd's) and device (its name) from the fd itself. Importing an
 * fd of this process's own allocation answers the same handle value with one more reference
 * (valid again if it had been released). Memory left pending by a process that exits stays on
 * the shared counters (nobody is left to look at it).
 */
#define LK_FD 0
#define LK_HOLDER 1
#define LK_SERIAL 2
#define VMM_MAGIC 0x564d4d48U
struct vmm {
    unsigned int magic;
    int fd, dev;
    int type_mask;              /* prop->requestedHandleTypes */
    size_t size;
    int refs, maps;             /* g_vmm_lock */
    int shared;                 /* g_vmm_lock: exported or imported (its end is decided with the others) */
    int pending;                /* g_vmm_lock: no reference or mapping left here, an exported fd open */
    struct vmm *next_shared;    /* g_vmm_lock: g_shared list */
};

struct vmm_map {
    uintptr_t start, end;
    struct vmm *v;
};
static pthread_mutex_t g_vmm_lock = PTHREAD_MUTEX_INITIALIZER;
static struct vmm_map *g_maps;
static size_t g_nmaps, g_capmaps;
static struct vmm *g_shared;    /* exported and imported allocations (import looks them up) */
static atomic_int g_npending;   /* how many of them are pending (one load when none) */

/* A handle the caller may still use (lock held). */
static struct vmm *vmm_live(CUmemGenericAllocationHandle handle)
{
    struct vmm *v = (struct vmm *)(uintptr_t)handle;
    return v && v->magic == VMM_MAGIC && v->refs > 0 ? v : NULL;
}

/* `local`: gone from this process's view only (another process still holds the memory). */
static void vmm_free(struct vmm *v, int local)
{
    v->magic = 0;
    close(v->fd);
    if (v->dev >= 0) {
        if (local)
            fc_mem_charge_local(v->dev, -(long long)v->size);
        else
            fc_mem_charge(v->dev, -(long long)v->size);
    }
    free(v);
}

static int ofd_lock(int fd, short type, off_t at, int wait)
{
    struct flock l = { .l_type = type, .l_whence = SEEK_SET, .l_start = at, .l_len = 1 };
    return fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &l);
}

/* Whether another open file description holds a lock on byte `at` of fd's file. */
static int ofd_others(int fd, off_t at)
{
    struct flock l = { .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = at, .l_len = 1 };
    return fcntl(fd, F_OFD_GETLK, &l) == 0 && l.l_type != F_UNLCK;
}

/* g_vmm_lock held. A shared allocation with nothing left here: 0 keep it (pending: an exported fd
 * is open and no other process holds it), 1 gone from this process only, 2 gone from the device. */
static int shared_end(struct vmm *v)
{
    int holders, fds;

    ofd_lock(v->fd, F_WRLCK, LK_SERIAL, 1);
    ofd_lock(v->fd, F_UNLCK, LK_HOLDER, 0);
    holders = ofd_others(v->fd, LK_HOLDER);
    fds = ofd_others(v->fd, LK_FD);
    ofd_lock(v->fd, F_UNLCK, LK_SERIAL, 0);
    return holders ? 1 : fds ? 0 : 2;
}

static void unlink_shared(struct vmm *v)
{
    for (struct vmm **p = &g_shared; *p; p = &(*p)->next_shared)
        if (*p == v) {
            *p = v->next_shared;
            return;
        }
}

/* g_vmm_lock held. v has no reference and no mapping left: 0 keep it, else free it (outside the
 * lock) with vmm_free(v, result == 1). */
static int vmm_gone(struct vmm *v)
{
    int r;

    if (!v->shared)
        return 2;
    if ((r = shared_end(v)) == 0) {
        if (!v->pending) {
            v->pending = 1;
            atomic_fetch_add(&g_npending, 1);
        }
        return 0;
    }
    if (v->pending) {
        v->pending = 0;
        atomic_fetch_sub(&g_npending, 1);
    }
    unlink_shared(v);
    return r;
}

void fc_vmm_reap(void)
{
    struct vmm *gone[64];
    int how[64], n = 0;

    if (atomic_load_explicit(&g_npending, memory_order_relaxed) == 0)
        return;
    pthread_mutex_lock(&g_vmm_lock);
    for (struct vmm *v = g_shared, *next; v && n < 64; v = next) {
        next = v->next_shared;
        if (v->pending && (how[n] = vmm_gone(v)) != 0)
            gone[n++] = v;
    }
    pthread_mutex_unlock(&g_vmm_lock);
    for (int i = 0; i < n; i++)
        vmm_free(gone[i], how[i] == 1);
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
    char name[32];
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
    fc_vmm_reap();
    if (!(v = calloc(1, sizeof *v)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (dev >= 0 && fc_mem_charge(dev, (long long)size) != 0) {
        free(v);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* The name carries the device: an importing process reads it back (the size is the file's). */
    snprintf(name, sizeof name, "fakecuda-vmm-d%d", dev);
    v->fd = memfd_create(name, MFD_CLOEXEC);
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
    int gone = 0;

    FC_COUNT(cuMemRelease);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_vmm_lock);
    if (!(v = vmm_live(handle))) {
        pthread_mutex_unlock(&g_vmm_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (--v->refs == 0 && v->maps == 0)
        gone = vmm_gone(v);
    pthread_mutex_unlock(&g_vmm_lock);
    if (gone)
        vmm_free(v, gone == 1);
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
    int how[64];
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
                if (--m.v->maps == 0 && m.v->refs == 0 && (how[ngone] = vmm_gone(m.v)) != 0)
                    gone[ngone++] = m.v;
            } else {
                g_maps[j++] = m;
            }
        }
        g_nmaps = j;
    }
    pthread_mutex_unlock(&g_vmm_lock);
    for (size_t i = 0; i < ngone; i++)
        vmm_free(gone[i], how[i] == 1);
    return rc;
}

FC_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    FC_COUNT(cuMemSetAccess);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    return ptr && size && desc && count ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* A new open file description of the same file (an fd of its own, with locks of its own). */
static int reopen(int fd)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    return open(path, O_RDWR | O_CLOEXEC);
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
    else if ((fd = reopen(v->fd)) < 0 || ofd_lock(fd, F_RDLCK, LK_FD, 0) != 0)
        rc = CUDA_ERROR_OUT_OF_MEMORY;      /* a new description: its lock lives as long as its fds */
    else if (!v->shared && ofd_lock(v->fd, F_RDLCK, LK_HOLDER, 0) != 0)
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (rc == CUDA_SUCCESS) {
        if (!v->shared) {
            v->shared = 1;
            v->next_shared = g_shared;
            g_shared = v;
        }
        *(int *)shareableHandle = fd;
    } else if (fd >= 0) {
        close(fd);
    }
    pthread_mutex_unlock(&g_vmm_lock);
    return rc;
}

/* An fd exported by this process is its own allocation again; one from another process (of this
 * fake: a memfd named by cuMemCreate) is a new handle to the same memory, on a description of its
 * own (the received fd may be closed at once). */
FC_API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle, int type)
{
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    int fd = (int)(intptr_t)osHandle, dev;
    char path[64], name[128];
    struct stat st;
    struct vmm *v;
    ssize_t n;

    FC_COUNT(cuMemImportFromShareableHandle);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (fstat(fd, &st) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_vmm_lock);
    for (v = g_shared; v; v = v->next_shared) {
        struct stat mine;
        if (fstat(v->fd, &mine) == 0 && mine.st_dev == st.st_dev && mine.st_ino == st.st_ino) {
            if (v->refs == 0 && v->maps == 0 && ofd_lock(v->fd, F_RDLCK, LK_HOLDER, 0) != 0)
                break;
            if (v->pending) {
                v->pending = 0;
                atomic_fetch_sub(&g_npending, 1);
            }
            v->refs++;
            *handle = (CUmemGenericAllocationHandle)(uintptr_t)v;
            rc = CUDA_SUCCESS;
            break;
        }
    }
    pthread_mutex_unlock(&g_vmm_lock);
    if (v)
        return rc;
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    if ((n = readlink(path, name, sizeof name - 1)) <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    name[n] = 0;
    if (sscanf(name, "/memfd:fakecuda-vmm-d%d", &dev) != 1 || st.st_size <= 0 || (dev >= 0 && !valid_dev(dev)))
        return CUDA_ERROR_INVALID_VALUE;
    if (!(v = calloc(1, sizeof *v)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    if ((v->fd = reopen(fd)) < 0 || ofd_lock(v->fd, F_RDLCK, LK_HOLDER, 0) != 0) {
        if (v->fd >= 0)
            close(v->fd);
        free(v);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    v->magic = VMM_MAGIC;
    v->dev = dev;
    v->size = (size_t)st.st_size;
    v->refs = 1;
    v->shared = 1;
    v->type_mask = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    if (dev >= 0)
        fc_mem_charge_local(dev, (long long)v->size);   /* on the device already: not charged again */
    pthread_mutex_lock(&g_vmm_lock);
    v->next_shared = g_shared;
    g_shared = v;
    pthread_mutex_unlock(&g_vmm_lock);
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)v;
    return CUDA_SUCCESS;
}
