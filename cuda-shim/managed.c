/*
 * managed.c - managed memory (cuMemAllocManaged) and its prefetches, as the driver API documents
 * them: the pages of a managed allocation are resident somewhere (a device or the host), and
 * cuMemPrefetchAsync (v1: a device or CU_DEVICE_CPU; _v2, CUDA 12.2: a CUmemLocation, where the
 * host types are host memory and a device's locality domain is that device's memory), its _ptsz
 * variants and the CUDA 13 batch forms (cuMemPrefetchBatchAsync, cuMemDiscardAndPrefetchBatchAsync)
 * move them. Work is synchronous, so a prefetch has moved the pages when it returns.
 *
 * Residency is kept per page of FC_MANAGED_PAGE bytes from the allocation's start (a prefetch
 * moves every page its range touches), and each device's held bytes (fakecuda_stats) count the
 * pages resident there: what a device physically holds. A new allocation's pages are resident
 * on the device of the context that made it. When the destination cannot hold a page, the real
 * driver may evict other managed memory to the host; this fake leaves that page where it is, so
 * no device ever holds more than it has. Freeing (cuMemFree_v2, or the end of the context that
 * made it: documented as for cuMemAlloc) gives every page back wherever it is.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/mman.h>

#include "internal.h"

#define FC_MANAGED_PAGE (2ULL << 20)
#define HOST (-1)
#define CU_DEVICE_CPU (-1)

struct managed {
    uintptr_t base;
    size_t size, maplen;
    struct fc_ctx *ctx;     /* the context that made it */
    signed char *where;     /* per page: device ordinal, or HOST */
    struct managed *next;
};

static pthread_mutex_t g_managed_lock = PTHREAD_MUTEX_INITIALIZER;
static struct managed *g_managed;

static size_t npages(const struct managed *m)
{
    return (m->size + FC_MANAGED_PAGE - 1) / FC_MANAGED_PAGE;
}

static long long page_bytes(const struct managed *m, size_t p)
{
    size_t end = (p + 1) * FC_MANAGED_PAGE;
    return (long long)(end > m->size ? m->size - p * FC_MANAGED_PAGE : FC_MANAGED_PAGE);
}

FC_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    struct fc_ctx *ctx;
    struct managed *m;
    CUresult rc;
    void *p;

    FC_COUNT(cuMemAllocManaged);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!dptr || bytesize == 0 || (flags != 1 && flags != 2))  /* CU_MEM_ATTACH_GLOBAL / _HOST */
        return CUDA_ERROR_INVALID_VALUE;
    if (!(ctx = fc_current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    atomic_fetch_add_explicit(&fc_stats[ctx->dev].alloc_calls, 1, memory_order_relaxed);
    if ((rc = fc_mem_inject()) != 0)
        return rc;
    if (!(m = calloc(1, sizeof *m)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->size = bytesize;
    m->maplen = (bytesize + 4095) & ~(size_t)4095;
    m->ctx = ctx;
    if (!(m->where = malloc(npages(m)))) {
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (size_t i = 0; i < npages(m); i++)
        m->where[i] = (signed char)ctx->dev;
    if (fc_mem_account(ctx->dev, (long long)bytesize, 1) != 0) {
        free(m->where);
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    p = mmap(NULL, m->maplen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        fc_mem_account(ctx->dev, -(long long)bytesize, -1);
        free(m->where);
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->base = (uintptr_t)p;
    pthread_mutex_lock(&g_managed_lock);
    m->next = g_managed;
    g_managed = m;
    pthread_mutex_unlock(&g_managed_lock);
    *dptr = (CUdeviceptr)m->base;
    return CUDA_SUCCESS;
}

/* Every page back from wherever it is resident; the allocation is already unlinked. */
static void managed_release(struct managed *m)
{
    int home = m->ctx->dev;

    for (size_t i = 0; i < npages(m); i++)
        if (m->where[i] != HOST)
            fc_mem_account(m->where[i], -page_bytes(m, i), 0);
    fc_mem_account(home, 0, -1);
    atomic_fetch_add_explicit(&fc_stats[home].free_calls, 1, memory_order_relaxed);
    munmap((void *)m->base, m->maplen);
    free(m->where);
    free(m);
}

int fc_managed_free(uintptr_t p)
{
    struct managed **pp, *m = NULL;

    pthread_mutex_lock(&g_managed_lock);
    for (pp = &g_managed; *pp; pp = &(*pp)->next)
        if ((*pp)->base == p) {
            m = *pp;
            *pp = m->next;
            break;
        }
    pthread_mutex_unlock(&g_managed_lock);
    if (!m)
        return -1;
    managed_release(m);
    return 0;
}

void fc_managed_ctx_gone(struct fc_ctx *c)
{
    struct managed **pp, *m, *gone = NULL;

    pthread_mutex_lock(&g_managed_lock);
    for (pp = &g_managed; (m = *pp);) {
        if (m->ctx == c) {
            *pp = m->next;
            m->next = gone;
            gone = m;
        } else {
            pp = &m->next;
        }
    }
    pthread_mutex_unlock(&g_managed_lock);
    while ((m = gone)) {
        gone = m->next;
        managed_release(m);
    }
}

/* One prefetch of a batch: [ptr, ptr + count) to dst (a device ordinal or HOST). */
struct prefetch_op {
    uintptr_t ptr;
    size_t count;
    int dst;
};

/* The allocation holding the whole range (lock held), or NULL: documented, the range must be
 * managed memory. */
static struct managed *find_range(uintptr_t ptr, size_t count)
{
    for (struct managed *m = g_managed; m; m = m->next)
        if (ptr >= m->base && ptr - m->base < m->size && count <= m->size - (ptr - m->base))
            return m;
    return NULL;
}

/* Checks every operation first (a batch with one bad range moves nothing), then moves the pages. */
static CUresult prefetch(const struct prefetch_op *ops, size_t n, CUstream s)
{
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (fc_stream_dev(s) < 0)       /* a bad stream, or a default stream with no context */
        return (uintptr_t)s > 2 ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_managed_lock);
    for (size_t i = 0; i < n; i++)
        if (ops[i].count == 0 || !find_range(ops[i].ptr, ops[i].count)) {
            pthread_mutex_unlock(&g_managed_lock);
            return CUDA_ERROR_INVALID_VALUE;
        }
    for (size_t i = 0; i < n; i++) {
        struct managed *m = find_range(ops[i].ptr, ops[i].count);
        size_t first = (ops[i].ptr - m->base) / FC_MANAGED_PAGE;
        size_t last = (ops[i].ptr - m->base + ops[i].count - 1) / FC_MANAGED_PAGE;
        int dst = ops[i].dst;

        for (size_t p = first; p <= last; p++) {
            long long b = page_bytes(m, p);
            if (m->where[p] == dst)
                continue;
            if (dst != HOST && fc_mem_account(dst, b, 0) != 0)
                continue;       /* does not fit: stays where it is */
            if (m->where[p] != HOST)
                fc_mem_account(m->where[p], -b, 0);
            m->where[p] = (signed char)dst;
        }
    }
    pthread_mutex_unlock(&g_managed_lock);
    return CUDA_SUCCESS;
}

static CUresult prefetch_v1(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream s)
{
    struct prefetch_op op = { (uintptr_t)devPtr, count, dstDevice };

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dstDevice != CU_DEVICE_CPU && !valid_dev(dstDevice))
        return CUDA_ERROR_INVALID_DEVICE;
    return prefetch(&op, 1, s);
}

static CUresult prefetch_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags,
                            CUstream s)
{
    struct prefetch_op op = { (uintptr_t)devPtr, count, HOST };
    CUresult rc;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (flags)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = fc_location_dev(&location, &op.dst)) != CUDA_SUCCESS)
        return rc;
    return prefetch(&op, 1, s);
}

FC_API CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream)
{
    FC_COUNT(cuMemPrefetchAsync);
    return prefetch_v1(devPtr, count, dstDevice, hStream);
}

FC_API CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream)
{
    FC_COUNT(cuMemPrefetchAsync_ptsz);
    return prefetch_v1(devPtr, count, dstDevice, fc_ptsz_stream(hStream));
}

FC_API CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                      unsigned int flags, CUstream hStream)
{
    FC_COUNT(cuMemPrefetchAsync_v2);
    return prefetch_v2(devPtr, count, location, flags, hStream);
}

FC_API CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                           unsigned int flags, CUstream hStream)
{
    FC_COUNT(cuMemPrefetchAsync_v2_ptsz);
    return prefetch_v2(devPtr, count, location, flags, fc_ptsz_stream(hStream));
}

/* prefetchLocs[i] applies from operation prefetchLocIdxs[i] up to the next entry's index (the
 * first entry's index must be 0, the indices increasing). */
static CUresult prefetch_batch(CUdeviceptr *dptrs, size_t *sizes, size_t count, CUmemLocation *locs,
                               size_t *locIdxs, size_t numLocs, unsigned long long flags, CUstream s)
{
    struct prefetch_op *ops;
    CUresult rc = CUDA_SUCCESS;
    size_t l = 0;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!dptrs || !sizes || count == 0 || !locs || !locIdxs || numLocs == 0 || numLocs > count ||
        locIdxs[0] != 0 || flags)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 1; i < numLocs; i++)
        if (locIdxs[i] <= locIdxs[i - 1] || locIdxs[i] >= count)
            return CUDA_ERROR_INVALID_VALUE;
    if (!(ops = calloc(count, sizeof *ops)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    for (size_t i = 0; i < count && rc == CUDA_SUCCESS; i++) {
        if (l + 1 < numLocs && i == locIdxs[l + 1])
            l++;
        ops[i].ptr = (uintptr_t)dptrs[i];
        ops[i].count = sizes[i];
        rc = fc_location_dev(&locs[l], &ops[i].dst);
    }
    if (rc == CUDA_SUCCESS)
        rc = prefetch(ops, count, s);
    free(ops);
    return rc;
}

FC_API CUresult cuMemPrefetchBatchAsync(CUdeviceptr *dptrs, size_t *sizes, size_t count, CUmemLocation *prefetchLocs,
                                        size_t *prefetchLocIdxs, size_t numPrefetchLocs, unsigned long long flags,
                                        CUstream hStream)
{
    FC_COUNT(cuMemPrefetchBatchAsync);
    return prefetch_batch(dptrs, sizes, count, prefetchLocs, prefetchLocIdxs, numPrefetchLocs, flags, hStream);
}

FC_API CUresult cuMemPrefetchBatchAsync_ptsz(CUdeviceptr *dptrs, size_t *sizes, size_t count,
                                             CUmemLocation *prefetchLocs, size_t *prefetchLocIdxs,
                                             size_t numPrefetchLocs, unsigned long long flags, CUstream hStream)
{
    FC_COUNT(cuMemPrefetchBatchAsync_ptsz);
    return prefetch_batch(dptrs, sizes, count, prefetchLocs, prefetchLocIdxs, numPrefetchLocs, flags,
                          fc_ptsz_stream(hStream));
}

/* The contents are discarded, then the ranges prefetched: where the pages end up is the same. */
FC_API CUresult cuMemDiscardAndPrefetchBatchAsync(CUdeviceptr *dptrs, size_t *sizes, size_t count,
                                                  CUmemLocation *prefetchLocs, size_t *prefetchLocIdxs,
                                                  size_t numPrefetchLocs, unsigned long long flags, CUstream hStream)
{
    FC_COUNT(cuMemDiscardAndPrefetchBatchAsync);
    return prefetch_batch(dptrs, sizes, count, prefetchLocs, prefetchLocIdxs, numPrefetchLocs, flags, hStream);
}

FC_API CUresult cuMemDiscardAndPrefetchBatchAsync_ptsz(CUdeviceptr *dptrs, size_t *sizes, size_t count,
                                                       CUmemLocation *prefetchLocs, size_t *prefetchLocIdxs,
                                                       size_t numPrefetchLocs, unsigned long long flags,
                                                       CUstream hStream)
{
    FC_COUNT(cuMemDiscardAndPrefetchBatchAsync_ptsz);
    return prefetch_batch(dptrs, sizes, count, prefetchLocs, prefetchLocIdxs, numPrefetchLocs, flags,
                          fc_ptsz_stream(hStream));
}
