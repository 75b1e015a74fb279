/*
 * fakemem.c - device memory of the fake driver, simulated on host memory.
 *
 * A device pointer is a plain host address, so tests can write through it.
 * Allocation must be cheap (tests do millions of alloc/free pairs from many
 * threads), so there is no mmap per small allocation:
 *
 *  - Address space is reserved lazily, per device, in 64 MiB chunks
 *    (MAP_NORESERVE, aligned to 64 MiB so a pointer maps to its chunk by a
 *    shift).  A chunk is cut into 1 MiB slabs; each slab serves one
 *    power-of-two size class (256 B .. 1 MiB), which gives the 256-byte
 *    minimum alignment for free.
 *  - Per class there is a free list threaded through the freed blocks
 *    themselves, and a bump pointer into the class's current slab.
 *  - Each slab keeps the requested size of every block (0 = free), which is
 *    what frees subtract from bytes_held and what detects bad/double frees,
 *    and the context that allocated it: destroying a context (cuCtxDestroy,
 *    the last cuDevicePrimaryCtxRelease, a primary reset) frees its blocks,
 *    as the documentation of cuCtxDestroy states for cuMemAlloc, pitched and
 *    managed memory (fc_ctx_free_memory).
 *  - Blocks over 1 MiB get their own mapping, recorded in a small hash table.
 *  - The legacy v1 API (32-bit CUdeviceptr) uses a second arena whose
 *    mappings are made with MAP_32BIT, so its pointers fit in 32 bits.
 *
 * Capacity is the sum of requested sizes, checked against the device total.
 * One mutex per device; chunk lookup is lock-free (chunks are never unmapped).
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

#define CHUNK_SHIFT 26                          /* 64 MiB */
#define CHUNK_SIZE (1UL << CHUNK_SHIFT)
#define SLAB_SHIFT 20                           /* 1 MiB */
#define SLAB_SIZE (1UL << SLAB_SHIFT)
#define SLABS_PER_CHUNK (1 << (CHUNK_SHIFT - SLAB_SHIFT))
#define MIN_SHIFT 8                             /* 256 B */
#define NCLASS (SLAB_SHIFT - MIN_SHIFT + 1)     /* 256 B .. 1 MiB */
#define SMALL_MAX SLAB_SIZE

enum { ARENA_NORMAL, ARENA_LOW32, NARENA };

struct slab {
    int cls;                    /* -1 = not yet carved */
    uint32_t *sizes;            /* requested size per block, 0 = free */
    struct fc_ctx **owners;     /* context that allocated each live block */
};

struct chunk {
    uintptr_t base;
    int dev, arena;             /* immutable once published */
    int slabs_used;
    struct slab slabs[SLABS_PER_CHUNK];
};

struct arena {
    void *free_head[NCLASS];    /* singly linked through the blocks */
    uintptr_t bump[NCLASS], bump_end[NCLASS];
    struct chunk *cur;          /* chunk that still has uncarved slabs */
};

struct device {
    pthread_mutex_t lock;
    unsigned long long held, peak, live;
    struct arena arenas[NARENA];
};

static struct device g_dev[FC_MAX_DEVICES] = {
#define D { .lock = PTHREAD_MUTEX_INITIALIZER }
    D, D, D, D, D, D, D, D, D, D, D, D, D, D, D, D
#undef D
};

/* ------------------------------------------------- chunk lookup (lock-free) */

#define CHUNK_TABLE_BITS 16
#define CHUNK_TABLE_SIZE (1U << CHUNK_TABLE_BITS)
static _Atomic uintptr_t g_chunk_keys[CHUNK_TABLE_SIZE];   /* base >> CHUNK_SHIFT */
static struct chunk *g_chunk_vals[CHUNK_TABLE_SIZE];
static pthread_mutex_t g_chunk_lock = PTHREAD_MUTEX_INITIALIZER;

static unsigned chunk_hash(uintptr_t key)
{
    return (unsigned)((key * 0x9e3779b97f4a7c15ULL) >> (64 - CHUNK_TABLE_BITS));
}

static int chunk_publish(struct chunk *c)
{
    uintptr_t key = c->base >> CHUNK_SHIFT;
    unsigned h = chunk_hash(key);
    int ok = 0;

    pthread_mutex_lock(&g_chunk_lock);
    for (unsigned i = 0; i < CHUNK_TABLE_SIZE; i++, h = (h + 1) & (CHUNK_TABLE_SIZE - 1)) {
        if (atomic_load_explicit(&g_chunk_keys[h], memory_order_relaxed) == 0) {
            g_chunk_vals[h] = c;
            atomic_store_explicit(&g_chunk_keys[h], key, memory_order_release);
            ok = 1;
            break;
        }
    }
    pthread_mutex_unlock(&g_chunk_lock);
    return ok;
}

static struct chunk *chunk_find(uintptr_t ptr)
{
    uintptr_t key = ptr >> CHUNK_SHIFT, k;
    unsigned h = chunk_hash(key);

    if (key == 0)
        return NULL;
    while ((k = atomic_load_explicit(&g_chunk_keys[h], memory_order_acquire)) != 0) {
        if (k == key)
            return g_chunk_vals[h];
        h = (h + 1) & (CHUNK_TABLE_SIZE - 1);
    }
    return NULL;
}

/* --------------------------------------------- large blocks (own mapping) */

struct large {
    uintptr_t addr;
    size_t maplen;
    unsigned long long req;
    int dev;
    struct fc_ctx *ctx;         /* the context that allocated it */
    struct large *next;
};

#define LARGE_BUCKETS 4096
static struct large *g_large[LARGE_BUCKETS];
static pthread_mutex_t g_large_lock = PTHREAD_MUTEX_INITIALIZER;

static unsigned large_hash(uintptr_t a)
{
    return (unsigned)(((a >> 12) * 0x9e3779b97f4a7c15ULL) >> 52);   /* 12 bits */
}

static void large_insert(struct large *l)
{
    unsigned h = large_hash(l->addr);

    pthread_mutex_lock(&g_large_lock);
    l->next = g_large[h];
    g_large[h] = l;
    pthread_mutex_unlock(&g_large_lock);
}

static struct large *large_remove(uintptr_t a)
{
    struct large **pp, *l = NULL;

    pthread_mutex_lock(&g_large_lock);
    for (pp = &g_large[large_hash(a)]; *pp; pp = &(*pp)->next)
        if ((*pp)->addr == a) {
            l = *pp;
            *pp = l->next;
            break;
        }
    pthread_mutex_unlock(&g_large_lock);
    return l;
}

/* ------------------------------------------------------------- mappings */

static int map_flags(int arena)
{
    int f = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
#if defined(__x86_64__)
    if (arena == ARENA_LOW32)
        f |= MAP_32BIT;
#else
    (void)arena;
#endif
    return f;
}

static void *map_region(size_t len, int arena)
{
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, map_flags(arena), -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* A new 64 MiB-aligned chunk: over-map by one chunk and trim the ends. */
static struct chunk *chunk_new(int dev, int arena)
{
    struct chunk *c;
    uintptr_t raw, base;

    c = malloc(sizeof *c);
    if (!c)
        return NULL;
    raw = (uintptr_t)map_region(2 * CHUNK_SIZE, arena);
    if (!raw) {
        free(c);
        return NULL;
    }
    base = (raw + CHUNK_SIZE - 1) & ~(CHUNK_SIZE - 1);
    if (base > raw)
        munmap((void *)raw, base - raw);
    if (raw + 2 * CHUNK_SIZE > base + CHUNK_SIZE)
        munmap((void *)(base + CHUNK_SIZE), raw + 2 * CHUNK_SIZE - (base + CHUNK_SIZE));
    c->base = base;
    c->dev = dev;
    c->arena = arena;
    c->slabs_used = 0;
    for (int i = 0; i < SLABS_PER_CHUNK; i++) {
        c->slabs[i].cls = -1;
        c->slabs[i].sizes = NULL;
        c->slabs[i].owners = NULL;
    }
    if (!chunk_publish(c)) {
        munmap((void *)base, CHUNK_SIZE);
        free(c);
        return NULL;
    }
    return c;
}

static int size_class(size_t size)
{
    if (size <= (1UL << MIN_SHIFT))
        return 0;
    return (64 - __builtin_clzll((unsigned long long)(size - 1))) - MIN_SHIFT;
}

/* Hand out one block of class `cls`; caller holds the device lock. */
static uintptr_t small_get(struct device *d, int devno, int arena, int cls,
                           size_t req, struct fc_ctx *owner)
{
    struct arena *a = &d->arenas[arena];
    struct chunk *c;
    struct slab *s;
    uintptr_t p;

    if (a->free_head[cls]) {
        p = (uintptr_t)a->free_head[cls];
        memcpy(&a->free_head[cls], (void *)p, sizeof(void *));
    } else {
        if (a->bump[cls] >= a->bump_end[cls]) {
            /* Carve a fresh slab for this class. */
            c = a->cur;
            if (!c || c->slabs_used == SLABS_PER_CHUNK) {
                if (!(c = chunk_new(devno, arena)))
                    return 0;
                a->cur = c;
            }
            s = &c->slabs[c->slabs_used];
            s->sizes = calloc(SLAB_SIZE >> (MIN_SHIFT + cls), sizeof(uint32_t));
            s->owners = calloc(SLAB_SIZE >> (MIN_SHIFT + cls), sizeof(struct fc_ctx *));
            if (!s->sizes || !s->owners) {
                free(s->sizes);
                free(s->owners);
                s->sizes = NULL;
                s->owners = NULL;
                return 0;
            }
            s->cls = cls;
            a->bump[cls] = c->base + ((uintptr_t)c->slabs_used << SLAB_SHIFT);
            a->bump_end[cls] = a->bump[cls] + SLAB_SIZE;
            c->slabs_used++;
        }
        p = a->bump[cls];
        a->bump[cls] += 1UL << (MIN_SHIFT + cls);
    }
    c = chunk_find(p);
    s = &c->slabs[(p - c->base) >> SLAB_SHIFT];
    s->sizes[(p & (SLAB_SIZE - 1)) >> (MIN_SHIFT + cls)] = (uint32_t)req;
    s->owners[(p & (SLAB_SIZE - 1)) >> (MIN_SHIFT + cls)] = owner;
    return p;
}

/* Book-keeping of a successful allocation or free; device lock held. `shared`: the bytes are new
 * to (or gone from) the device itself, not only from this process's view of it. */
static inline __attribute__((always_inline)) void account_in(struct device *d, int devno, long long delta, int live_delta, int shared)
{
    struct fc_devstats *st = &fc_stats[devno];

    if (shared)
        fc_shared_device_account(devno, delta);

    d->held += (unsigned long long)delta;
    d->live += (unsigned long long)(long long)live_delta;
    if (d->held > d->peak)
        d->peak = d->held;
    atomic_store_explicit(&st->bytes_held, d->held, memory_order_relaxed);
    atomic_store_explicit(&st->live_allocs, d->live, memory_order_relaxed);
    atomic_store_explicit(&st->peak_bytes, d->peak, memory_order_relaxed);
}

static void account(struct device *d, int devno, long long delta, int live_delta)
{
    account_in(d, devno, delta, live_delta, 1);
}

/* Common allocation path; `arena` selects the v2 or the 32-bit v1 space. */
static CUresult mem_alloc(uintptr_t *out, size_t size, int arena)
{
    struct fc_ctx *ctx;
    struct device *d;
    CUresult rc;
    uintptr_t p = 0;
    int dev;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (!(ctx = fc_current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    dev = ctx->dev;
    d = &g_dev[dev];
    atomic_fetch_add_explicit(&fc_stats[dev].alloc_calls, 1, memory_order_relaxed);

    if ((rc = fc_mem_inject()) != 0)
        return rc;
    if (size == 0)
        return CUDA_ERROR_INVALID_VALUE;

    pthread_mutex_lock(&d->lock);
    if (size > fc_cfg.mem[dev] - d->held) {
        pthread_mutex_unlock(&d->lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (size <= SMALL_MAX) {
        p = small_get(d, dev, arena, size_class(size), size, ctx);
        if (p)
            account(d, dev, (long long)size, 1);
        pthread_mutex_unlock(&d->lock);
    } else {
        /* Reserve the bytes, then map outside the lock. */
        struct large *l;
        size_t len = (size + 4095) & ~(size_t)4095;

        account(d, dev, (long long)size, 1);
        pthread_mutex_unlock(&d->lock);
        l = malloc(sizeof *l);
        p = l ? (uintptr_t)map_region(len, arena) : 0;
        if (p) {
            l->addr = p;
            l->maplen = len;
            l->req = size;
            l->dev = dev;
            l->ctx = ctx;
            large_insert(l);
        } else {
            free(l);
            pthread_mutex_lock(&d->lock);
            account(d, dev, -(long long)size, -1);
            pthread_mutex_unlock(&d->lock);
        }
    }
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *out = p;
    return CUDA_SUCCESS;
}

static CUresult mem_free(uintptr_t p)
{
    struct fc_ctx *ctx;
    struct chunk *c;
    struct large *l;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!(ctx = fc_current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;

    if ((c = chunk_find(p))) {
        struct device *d = &g_dev[c->dev];
        struct arena *a = &d->arenas[c->arena];
        struct slab *s;
        uintptr_t off = p & (SLAB_SIZE - 1);
        uint32_t *sz;
        CUresult rc = CUDA_ERROR_INVALID_VALUE;

        atomic_fetch_add_explicit(&fc_stats[c->dev].free_calls, 1, memory_order_relaxed);
        pthread_mutex_lock(&d->lock);
        s = &c->slabs[(p - c->base) >> SLAB_SHIFT];
        if (s->cls >= 0 && (off & ((1UL << (MIN_SHIFT + s->cls)) - 1)) == 0) {
            sz = &s->sizes[off >> (MIN_SHIFT + s->cls)];
            if (*sz) {
                account(d, c->dev, -(long long)*sz, -1);
                *sz = 0;
                memcpy((void *)p, &a->free_head[s->cls], sizeof(void *));
                a->free_head[s->cls] = (void *)p;
                rc = CUDA_SUCCESS;
            }
        }
        pthread_mutex_unlock(&d->lock);
        return rc;
    }
    if ((l = large_remove(p))) {
        struct device *d = &g_dev[l->dev];

        atomic_fetch_add_explicit(&fc_stats[l->dev].free_calls, 1, memory_order_relaxed);
        munmap((void *)l->addr, l->maplen);
        pthread_mutex_lock(&d->lock);
        account(d, l->dev, -(long long)l->req, -1);
        pthread_mutex_unlock(&d->lock);
        free(l);
        return CUDA_SUCCESS;
    }
    /* Managed memory has its own table (managed.c): looked up only when the arenas miss. */
    if (fc_managed_free(p) == 0)
        return CUDA_SUCCESS;
    /* Not ours: charge the attempt to the current context's device. */
    atomic_fetch_add_explicit(&fc_stats[ctx->dev].free_calls, 1, memory_order_relaxed);
    return CUDA_ERROR_INVALID_VALUE;
}

/* Frees every block context `c` allocated (the caller has destroyed or reset it). Walks the chunk
 * table and the large-block table: context teardown is rare, allocation stays a store. */
void fc_ctx_free_memory(struct fc_ctx *c)
{
    struct large *gone = NULL, **pp, *l;
    int dev = c->dev;
    struct device *d;

    if (!valid_dev(dev))
        return;
    d = &g_dev[dev];
    pthread_mutex_lock(&d->lock);
    for (unsigned h = 0; h < CHUNK_TABLE_SIZE; h++) {
        struct chunk *ch;

        if (!atomic_load_explicit(&g_chunk_keys[h], memory_order_acquire))
            continue;
        ch = g_chunk_vals[h];
        if (ch->dev != dev)
            continue;
        for (int i = 0; i < ch->slabs_used; i++) {
            struct slab *s = &ch->slabs[i];
            struct arena *a = &d->arenas[ch->arena];
            size_t n;

            if (s->cls < 0 || !s->sizes)
                continue;
            n = SLAB_SIZE >> (MIN_SHIFT + s->cls);
            for (size_t b = 0; b < n; b++) {
                uintptr_t p;

                if (!s->sizes[b] || s->owners[b] != c)
                    continue;
                p = ch->base + ((uintptr_t)i << SLAB_SHIFT) + (b << (MIN_SHIFT + s->cls));
                account(d, dev, -(long long)s->sizes[b], -1);
                s->sizes[b] = 0;
                s->owners[b] = NULL;
                memcpy((void *)p, &a->free_head[s->cls], sizeof(void *));
                a->free_head[s->cls] = (void *)p;
            }
        }
    }
    pthread_mutex_unlock(&d->lock);

    pthread_mutex_lock(&g_large_lock);
    for (unsigned h = 0; h < LARGE_BUCKETS; h++)
        for (pp = &g_large[h]; (l = *pp);) {
            if (l->ctx == c) {
                *pp = l->next;
                l->next = gone;
                gone = l;
            } else {
                pp = &l->next;
            }
        }
    pthread_mutex_unlock(&g_large_lock);
    while ((l = gone)) {
        gone = l->next;
        munmap((void *)l->addr, l->maplen);
        pthread_mutex_lock(&d->lock);
        account(d, dev, -(long long)l->req, -1);
        pthread_mutex_unlock(&d->lock);
        free(l);
    }
    fc_arrays_ctx_gone(c);
    fc_managed_ctx_gone(c);
}

/* Capacity charge for memory kept outside the arenas (pools, VMM, arrays, managed memory):
 * 0 on success, -1 when a positive delta does not fit the device. live_delta: allocations that
 * begin (1) or end (-1) with it; 0 for pages that move (managed memory, managed.c). */
int fc_mem_account(int dev, long long delta, int live_delta)
{
    struct device *d = &g_dev[dev];
    int ok = 0;

    pthread_mutex_lock(&d->lock);
    if (delta > 0 && (unsigned long long)delta > fc_cfg.mem[dev] - d->held)
        ok = -1;
    else
        account(d, dev, delta, live_delta);
    pthread_mutex_unlock(&d->lock);
    return ok;
}

/* This process's view only: memory another process allocated that this one now holds too (an
 * imported shareable handle), or stops holding while others still do. Never refused. */
void fc_mem_charge_local(int dev, long long delta)
{
    struct device *d = &g_dev[dev];

    pthread_mutex_lock(&d->lock);
    account_in(d, dev, delta, delta > 0 ? 1 : -1, 0);
    pthread_mutex_unlock(&d->lock);
}

int fc_mem_charge(int dev, long long delta)
{
    return fc_mem_account(dev, delta, delta > 0 ? 1 : -1);
}

/* Like fc_mem_charge, for memory no allocation hands out (contexts, modules): not a live block. */
int fc_mem_overhead(int dev, long long delta)
{
    return fc_mem_account(dev, delta, 0);
}

CUresult fc_mem_alloc_cur(CUdeviceptr *dptr, size_t size)
{
    uintptr_t p;
    CUresult rc = mem_alloc(dptr ? &p : NULL, size, ARENA_NORMAL);
    if (rc == CUDA_SUCCESS)
        *dptr = (CUdeviceptr)p;
    return rc;
}

/* ------------------------------------------------------------ entry points */

FC_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    uintptr_t p;
    CUresult rc;

    FC_COUNT(cuMemAlloc_v2);
    rc = mem_alloc(dptr ? &p : NULL, bytesize, ARENA_NORMAL);
    if (rc == CUDA_SUCCESS)
        *dptr = (CUdeviceptr)p;
    return rc;
}

FC_API CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    FC_COUNT(cuMemAlloc);
#if defined(__x86_64__)
    uintptr_t p;
    CUresult rc = mem_alloc(dptr ? &p : NULL, bytesize, ARENA_LOW32);

    if (rc == CUDA_SUCCESS) {
        if (p > 0xffffffffUL) {         /* cannot happen with MAP_32BIT */
            mem_free(p);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        *dptr = (CUdeviceptr_v1)p;      /* writes exactly 32 bits */
    }
    return rc;
#else
    (void)dptr;
    (void)bytesize;
    return fc_initialized() ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_NOT_INITIALIZED;
#endif
}

FC_API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    CUresult rc;

    FC_COUNT(cuMemFree_v2);
    rc = mem_free((uintptr_t)dptr);
    if (fc_cfg.free_delay_us)
        usleep((useconds_t)fc_cfg.free_delay_us);
    return rc;
}

FC_API CUresult cuMemFree(CUdeviceptr_v1 dptr)
{
    FC_COUNT(cuMemFree);
    return mem_free((uintptr_t)dptr);
}
