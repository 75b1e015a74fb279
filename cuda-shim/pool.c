/*
 * pool.c - stream-ordered allocation (memory pools) of the fake driver.
 *
 * What an interposer must get right about real pools, reproduced here:
 *  - a pool reserves device memory in granularity-sized segments and keeps
 *    freed blocks reserved for reuse (RESERVED_MEM_CURRENT stays up after a
 *    cuMemFreeAsync);
 *  - at a synchronize a pool gives back free segments above its release
 *    threshold (default pools: threshold 0, so everything free goes back);
 *  - cuMemPoolTrimTo gives back free segments down to the bytes to keep;
 *  - a pool destroyed while allocations from it are live returns at once, but
 *    (as documented) its resources are released only once no allocation from
 *    it is outstanding: the last cuMemFreeAsync gives back everything;
 *  - stream-ordered memory belongs to the stream's device (or the explicit
 *    pool's location), whatever context is current; a thread with no current
 *    context can allocate on an explicit stream;
 *  - fragmentation: each segment serves one allocation at a time (first fit),
 *    so a request can grow the pool although the free bytes would add up to it;
 *  - an allocation on a capturing stream allocates nothing: it becomes a graph
 *    memory node (graph.c), allocated when the graph is launched.
 * Work is synchronous, so "stream order" is program order.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

#define POOL_MAGIC 0x504f4f4cU
#define POOL_DEAD  0x44454144U   /* destroyed, allocations still live */

struct seg {
    void *mem;
    size_t size;            /* reserved bytes (multiple of the granularity) */
    size_t used;            /* bytes of the live allocation, 0 = free */
    struct seg *next;
};

struct fc_pool {
    unsigned int magic;
    int dev;
    unsigned long long threshold, reserved, used, reserved_high, used_high;
    struct seg *segs;
    struct fc_pool *next;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fc_pool g_default[FC_MAX_DEVICES];
static struct fc_pool *g_current[FC_MAX_DEVICES];  /* cuDeviceSetMemPool target */
static struct fc_pool *g_pools;                   /* every pool, default ones included */

/* Caller holds g_lock. */
static struct fc_pool *default_pool(int dev)
{
    struct fc_pool *p = &g_default[dev];

    if (p->magic != POOL_MAGIC) {
        p->magic = POOL_MAGIC;
        p->dev = dev;
        p->next = g_pools;
        g_pools = p;
    }
    return p;
}

static int pool_valid(struct fc_pool *p)
{
    for (struct fc_pool *it = g_pools; it; it = it->next)
        if (it == p)
            return p->magic == POOL_MAGIC;
    return 0;
}

/* Gives back free segments while more than `keep` bytes are reserved. */
static void trim(struct fc_pool *p, unsigned long long keep)
{
    struct seg **pp = &p->segs;

    while (*pp && p->reserved > keep) {
        struct seg *s = *pp;
        if (s->used) {
            pp = &s->next;
            continue;
        }
        *pp = s->next;
        p->reserved -= s->size;
        fc_mem_charge(p->dev, -(long long)s->size);
        free(s->mem);
        free(s);
    }
}

void fc_pools_sync(int dev)
{
    pthread_mutex_lock(&g_lock);
    for (struct fc_pool *p = g_pools; p; p = p->next)
        if (p->dev == dev && p->magic == POOL_MAGIC)
            trim(p, p->threshold);
    pthread_mutex_unlock(&g_lock);
}

static CUresult pool_alloc(CUdeviceptr *dptr, size_t size, struct fc_pool *p, CUstream stream)
{
    struct seg *s;
    int dev = fc_stream_dev(stream);
    CUresult rc = CUDA_SUCCESS;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!dptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0)
        return (uintptr_t)stream > 2 ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    if ((rc = fc_mem_inject()) != 0)
        return rc;
    if (fc_capture_alloc(stream, dptr, size, dev))
        return CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (!p)
        p = g_current[dev] ? g_current[dev] : default_pool(dev);
    else if (!pool_valid(p)) {
        pthread_mutex_unlock(&g_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (s = p->segs; s; s = s->next)       /* reuse reserved memory first */
        if (!s->used && s->size >= size)
            break;
    if (!s) {
        size_t len = (size + FC_GRANULARITY - 1) & ~(size_t)(FC_GRANULARITY - 1);
        if (fc_mem_charge(p->dev, (long long)len) != 0) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (!(s = calloc(1, sizeof *s)) || !(s->mem = aligned_alloc(4096, len))) {
            free(s);
            s = NULL;
            fc_mem_charge(p->dev, -(long long)len);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            s->size = len;
            s->next = p->segs;
            p->segs = s;
            p->reserved += len;
            if (p->reserved > p->reserved_high)
                p->reserved_high = p->reserved;
        }
    }
    if (s) {
        s->used = size;
        p->used += size;
        if (p->used > p->used_high)
            p->used_high = p->used;
        *dptr = (CUdeviceptr)(uintptr_t)s->mem;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static CUresult pool_free(CUdeviceptr dptr, CUstream stream)
{
    CUresult rc = CUDA_ERROR_INVALID_VALUE;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (stream && fc_stream_dev(stream) < 0)
        return CUDA_ERROR_INVALID_HANDLE;
    if (fc_capture_free(stream, dptr))
        return CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    for (struct fc_pool *p = g_pools; p && rc != CUDA_SUCCESS; p = p->next)
        for (struct seg *s = p->segs; s; s = s->next)
            if (s->used && (CUdeviceptr)(uintptr_t)s->mem == dptr) {
                p->used -= s->used;
                s->used = 0;        /* stays reserved until a sync or trim */
                rc = CUDA_SUCCESS;
                /* A destroyed pool's resources go once nothing from it is outstanding. */
                if (p->magic == POOL_DEAD && p->used == 0)
                    trim(p, 0);
                break;
            }
    pthread_mutex_unlock(&g_lock);
    /* Graph memory a launched graph left allocated, freed outside the graph. */
    if (rc != CUDA_SUCCESS && fc_graph_mem_free(dptr))
        rc = CUDA_SUCCESS;
    /* The block is reusable already: a late return is the window an interposer's trace must
     * stamp right (FAKECUDA_FREE_DELAY_US). */
    if (rc == CUDA_SUCCESS && fc_cfg.free_delay_us)
        usleep((useconds_t)fc_cfg.free_delay_us);
    return rc;
}


FC_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    FC_COUNT(cuMemAllocAsync);
    return pool_alloc(dptr, bytesize, NULL, hStream);
}

FC_API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    FC_COUNT(cuMemAllocAsync_ptsz);
    return pool_alloc(dptr, bytesize, NULL, fc_ptsz_stream(hStream));
}

FC_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                        CUstream hStream)
{
    FC_COUNT(cuMemAllocFromPoolAsync);
    return pool ? pool_alloc(dptr, bytesize, pool, hStream) : CUDA_ERROR_INVALID_VALUE;
}

FC_API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream hStream)
{
    FC_COUNT(cuMemAllocFromPoolAsync_ptsz);
    return pool ? pool_alloc(dptr, bytesize, pool, fc_ptsz_stream(hStream)) : CUDA_ERROR_INVALID_VALUE;
}

FC_API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    FC_COUNT(cuMemFreeAsync);
    return pool_free(dptr, hStream);
}

FC_API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    FC_COUNT(cuMemFreeAsync_ptsz);
    return pool_free(dptr, fc_ptsz_stream(hStream));
}

FC_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev)
{
    FC_COUNT(cuDeviceGetDefaultMemPool);
    DEV_CHECK(pool, dev);
    pthread_mutex_lock(&g_lock);
    *pool = default_pool(dev);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    FC_COUNT(cuDeviceGetMemPool);
    DEV_CHECK(pool, dev);
    pthread_mutex_lock(&g_lock);
    *pool = g_current[dev] ? g_current[dev] : default_pool(dev);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    struct fc_pool *p;
    CUresult rc;
    int dev;

    FC_COUNT(cuMemPoolCreate);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pool || !props)
        return CUDA_ERROR_INVALID_VALUE;
    if (props->allocType == CU_MEM_ALLOCATION_TYPE_MANAGED &&
        (props->location.type == CU_MEM_LOCATION_TYPE_NONE ||
         (fc_location_dev(&props->location, &dev) == 0 && dev < 0))) {
        /* CUDA 13 managed pool with no preferred location, or the host preferred (a hint): its
         * pages migrate to the device that uses them. The fake runs no kernels; it models pages
         * used by the device whose context is current at creation (device 0 without one), like
         * its cuMemAllocManaged. */
        struct fc_ctx *c = fc_current_ctx();
        dev = c ? c->dev : 0;
    } else if (props->allocType == CU_MEM_ALLOCATION_TYPE_PINNED || props->allocType == CU_MEM_ALLOCATION_TYPE_MANAGED) {
        /* Device memory: a device or one of its locality domains (CUDA 13.4). Host pools
         * (HOST_NUMA) are not modelled by the fake. */
        if ((rc = fc_location_dev(&props->location, &dev)) != 0)
            return rc;
        if (dev < 0)
            return CUDA_ERROR_NOT_SUPPORTED;
    } else {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!(p = calloc(1, sizeof *p)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    p->magic = POOL_MAGIC;
    p->dev = dev;
    pthread_mutex_lock(&g_lock);
    p->next = g_pools;
    g_pools = p;
    pthread_mutex_unlock(&g_lock);
    *pool = p;
    return CUDA_SUCCESS;
}

/* Destroying a pool with nothing outstanding gives back all its memory; with
 * live allocations it returns at once and the memory stays until the last of
 * them is freed (pool_free). The struct stays in the registry (marked dead) so
 * a stale handle is detected. */
FC_API CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    CUresult rc = CUDA_ERROR_INVALID_VALUE;

    FC_COUNT(cuMemPoolDestroy);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_lock);
    if (pool_valid(pool) && pool != &g_default[pool->dev]) {
        if (pool->used == 0) {
            trim(pool, 0);
            pool->magic = 0;
        } else {
            pool->magic = POOL_DEAD;
        }
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static CUresult pool_attr(CUmemoryPool pool, int attr, void *value, int set)
{
    CUresult rc = CUDA_SUCCESS;
    unsigned long long *v = value;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    if (!pool_valid(pool))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
        set ? (void)(pool->threshold = *v) : (void)(*v = pool->threshold);
    else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT && !set)
        *v = pool->reserved;
    else if (attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT && !set)
        *v = pool->used;
    else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
        set ? (void)(pool->reserved_high = 0) : (void)(*v = pool->reserved_high);
    else if (attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH)
        set ? (void)(pool->used_high = 0) : (void)(*v = pool->used_high);
    else if (attr >= 1 && attr <= 3)          /* reuse policy flags: accepted, ignored */
        set ? (void)0 : (void)(*(int *)value = 1);
    else
        rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

FC_API CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
    FC_COUNT(cuMemPoolSetAttribute);
    return pool_attr(pool, attr, value, 1);
}

FC_API CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value)
{
    FC_COUNT(cuMemPoolGetAttribute);
    return pool_attr(pool, attr, value, 0);
}

FC_API CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    CUresult rc = CUDA_SUCCESS;

    FC_COUNT(cuMemPoolTrimTo);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_lock);
    if (pool_valid(pool))
        trim(pool, minBytesToKeep);
    else
        rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* CUDA 12.5+ (cuCtxSynchronize_v2 is CUDA 13): synchronize a named context (NULL: the current
 * one); like cuCtxSynchronize, pools of its device give back what exceeds their thresholds. */
FC_API CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    struct fc_ctx *c = ctx ? ctx : fc_current_ctx();

    FC_COUNT(cuCtxSynchronize_v2);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    fc_pools_sync(c->dev);
    return CUDA_SUCCESS;
}

/* CUDA 13: the pool of a location (devices only here). */
static CUresult location_pool(CUmemoryPool *pool, const CUmemLocation *loc, int type, int current)
{
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pool || !loc || type != CU_MEM_ALLOCATION_TYPE_PINNED || loc->type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(loc->id))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    *pool = current && g_current[loc->id] ? g_current[loc->id] : default_pool(loc->id);
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemGetDefaultMemPool(CUmemoryPool *pool, CUmemLocation *location, int type)
{
    FC_COUNT(cuMemGetDefaultMemPool);
    return location_pool(pool, location, type, 0);
}

FC_API CUresult cuMemGetMemPool(CUmemoryPool *pool, CUmemLocation *location, int type)
{
    FC_COUNT(cuMemGetMemPool);
    return location_pool(pool, location, type, 1);
}

FC_API CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    CUresult rc = CUDA_SUCCESS;

    FC_COUNT(cuDeviceSetMemPool);
    DEV_CHECK(pool, dev);
    pthread_mutex_lock(&g_lock);
    if (!pool_valid(pool) || pool->dev != dev)
        rc = CUDA_ERROR_INVALID_VALUE;
    else
        g_current[dev] = pool;
    pthread_mutex_unlock(&g_lock);
    return rc;
}
