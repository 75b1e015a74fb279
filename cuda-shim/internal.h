/*
 * internal.h - state shared between the fake driver's translation units.
 * Nothing here is exported (the library is built with -fvisibility=hidden;
 * only FC_API functions are visible).
 */
#ifndef VRAMCAP_FAKECUDA_INTERNAL_H
#define VRAMCAP_FAKECUDA_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include "cuda_types.h"
#include "fakecuda.h"

#define FC_API __attribute__((visibility("default")))
#define FC_MAX_DEVICES 16
/* MULTIPROCESSOR_COUNT and MAX_THREADS_PER_MULTIPROCESSOR (an H100's): cuDeviceGetAttribute says
 * them, and a stack size costs that many resident threads' stacks (overhead.c). */
#define FC_SM_COUNT 132
#define FC_THREADS_PER_SM 2048

/* Entry point ids, one per exported symbol, from the shared list. */
enum fc_ep {
#define EP(base, sym, since, ptds) FC_EP_##sym,
#include "entrypoints.def"
#undef EP
    FC_EP_COUNT
};

/*
 * Per-entry-point call counters, one block per thread: counting is a plain load and store, no
 * locked instruction. A real driver counts nothing, and a shared atomic here would make every
 * driver call vramcap adds (cuCtxGetCurrent per allocation) look dearer than it is in benchmarks.
 * fakecuda_calls() sums the blocks (they are never freed, so threads that exited still count).
 */
struct fc_counter_block {
    atomic_ullong n[FC_EP_COUNT];
    struct fc_counter_block *next;
};
extern __thread struct fc_counter_block *fc_my_counters;
struct fc_counter_block *fc_counter_block_new(void);
static inline void fc_count(int ep)
{
    struct fc_counter_block *b = fc_my_counters;
    if (!b)
        b = fc_counter_block_new();
    if (!b)
        return;
    atomic_store_explicit(&b->n[ep], atomic_load_explicit(&b->n[ep], memory_order_relaxed) + 1,
                          memory_order_relaxed);
}
#define FC_COUNT(sym) fc_count(FC_EP_##sym)

/* Configuration, parsed once from the environment (see fc_config_load). */
struct fc_config {
    int device_count;
    int driver_version;
    int init_fail;                          /* 0 = cuInit succeeds */
    long free_delay_us;                     /* FAKECUDA_FREE_DELAY_US: cuMemFree_v2, cuMemFreeAsync return this late */
    long relaunch_delay_us;                 /* FAKECUDA_RELAUNCH_DELAY_US: see fc_config_load */
    int ctx_delay_us;                       /* FAKECUDA_CTX_DELAY_US: how long making a context takes */
    int ctx_setup_us;                       /* FAKECUDA_CTX_SETUP_US: ... before its memory is taken */
    unsigned long long mem[FC_MAX_DEVICES]; /* total bytes per device */
    unsigned long long ctx_bytes;           /* FAKECUDA_CTX_BYTES: device memory a context takes */
};
extern struct fc_config fc_cfg;
void fc_config_load(void);                  /* idempotent (pthread_once) */
int fc_initialized(void);                   /* cuInit succeeded */

static inline int valid_dev(CUdevice dev)
{
    return dev >= 0 && dev < fc_cfg.device_count;
}

/* Locality domains per device of the fake (CU_DEVICE_ATTRIBUTE_LOCALITY_DOMAIN_COUNT). */
#define FC_LOCALITY_DOMAINS 2

/* Where memory at a CUmemLocation lives: 0 with *dev the device (-1: host memory, HOST,
 * HOST_NUMA, HOST_NUMA_CURRENT), or the driver's error for a location that names no memory. A
 * locality domain is a portion of its device's memory (CUDA 13.4). */
static inline CUresult fc_location_dev(const CUmemLocation *l, int *dev)
{
    switch (l->type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        *dev = l->id;
        return valid_dev(l->id) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
    case CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN:
        *dev = l->id & 0xff;
        if (!valid_dev(*dev))
            return CUDA_ERROR_INVALID_DEVICE;
        return ((l->id >> 8) & 0xff) < FC_LOCALITY_DOMAINS ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
        *dev = -1;
        return CUDA_SUCCESS;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

/* Common prologue of the per-device entry points. */
#define DEV_CHECK(ptr, dev)                                  \
    do {                                                     \
        if (!fc_initialized()) return CUDA_ERROR_NOT_INITIALIZED; \
        if (!(ptr)) return CUDA_ERROR_INVALID_VALUE;         \
        if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE; \
    } while (0)

/* Contexts: a context only names its device; memory is per device. */
struct fc_ctx {
    int dev;
    int primary;
    int usage;              /* cuCtxCreate = 1, +1 per cuCtxAttach, -1 per cuCtxDetach (g_ctx_lock) */
    atomic_int destroyed;
    struct fc_ctx *next;    /* registry of cuCtxCreate'd contexts (never freed) */
    /* Device memory the context itself holds (overhead.c, under g_overhead_lock): the context,
     * its modules' globals, the heap and printf FIFO (reserved at its first module load), the
     * stack above the default. */
    unsigned long long ctx_bytes, module_bytes, heap_bytes, stack_bytes;
    size_t limits[7];       /* cuCtxSetLimit values; 0 = the default (overhead.c) */
    int modules;            /* modules loaded and not unloaded */
};
/* Current context of the calling thread, or NULL. */
struct fc_ctx *fc_current_ctx(void);
/* Primary contexts (context.c): one more reference (the first creates the context and takes its
 * memory: CUDA_ERROR_OUT_OF_MEMORY if it does not fit), one less (the last resets it, freeing its
 * memory); green.c retains one per green context. */
CUresult fc_primary_retain(int dev, struct fc_ctx **out);
CUresult fc_primary_release(int dev);
/* Whether c is the CUcontext of a live green context (green.c). */
int fc_green_ctx_valid(struct fc_ctx *c);
/* dev's primary context ended (its last release, a reset): what was allocated in the device's green
 * contexts, destroyed ones included, is the primary context's memory and goes with it (green.c;
 * g_ctx_lock held). Kept off the allocation path: blocks record the context current at allocation. */
void fc_green_primary_ended(int dev);

/* Per-device statistics; updated by the allocator. */
struct fc_devstats {
    atomic_ullong alloc_calls, free_calls, bytes_held, live_allocs, peak_bytes;
};
extern struct fc_devstats fc_stats[FC_MAX_DEVICES];

/* Allocator hooks (fakemem.c). */
void fc_mem_config_fail(long long nth, int code); /* from FAKECUDA_FAIL_ALLOC */
CUresult fc_mem_inject(void);                      /* the armed failure, or 0 */
int fc_mem_charge(int dev, long long delta);      /* 0 ok, -1 does not fit */
void fc_mem_charge_local(int dev, long long delta); /* this process's view only (imports) */
/* vmm.c: frees exported memory whose last holder was this process once no exported fd is open. */
void fc_vmm_reap(void);
int fc_mem_account(int dev, long long delta, int live_delta); /* fc_mem_charge, live count given */
/* Managed memory (managed.c): cuMemFree of one (0; -1: not managed memory), a context's end. */
int fc_managed_free(uintptr_t p);
void fc_managed_ctx_gone(struct fc_ctx *c);
int fc_mem_overhead(int dev, long long delta);    /* the same for memory no allocation returns */
/* Overhead (overhead.c): a context takes its memory when it begins (0 ok, else the error) and
 * gives back all it holds when it ends; a primary reset gives back its modules' part. */
CUresult fc_ctx_begin(struct fc_ctx *c);   /* called with g_ctx_lock held (context.c) */
/* fn on every live context (primary contexts retained, created ones not destroyed; green
 * contexts are their primary context's), under the context registry's lock, until one fails. */
CUresult fc_ctx_each_live(CUresult (*fn)(struct fc_ctx *, void *), void *arg);
void fc_ctx_finish(struct fc_ctx *c);
void fc_ctx_reset_modules(struct fc_ctx *c);
/* FAKECUDA_SHARED_DEVICE: one allocation's or free's bytes on the counters shared by processes. */
void fc_shared_device_account(int devno, long long delta);
CUresult fc_mem_alloc_cur(CUdeviceptr *dptr, size_t size); /* cuMemAlloc_v2 semantics */
/* A context was destroyed (or a primary context reset / released for the last time): free what
 * the documentation says goes with it (cuMemAlloc*, pitched, managed memory, arrays), not VMM
 * handles or stream-ordered memory, which belong to the device. */
void fc_ctx_free_memory(struct fc_ctx *c);
void fc_arrays_ctx_gone(struct fc_ctx *c);     /* arrays.c: arrays made in c */
/* Pools (pool.c): give back what exceeds each pool's release threshold (at synchronize). */
void fc_pools_sync(int dev);
int fc_stream_dev(CUstream s);              /* -1: bad stream or no context */
struct fc_ctx *fc_stream_ctx(CUstream s);   /* NULL: bad stream or no context */
/* Graphs (graph.c, graph_exec.c, graph_mem.c): an allocation or free on a capturing stream becomes a graph node (returns 1);
 * graph memory a launch left allocated is freed by cuMemFreeAsync (returns 1 if dptr was one). */
/* The stream a _ptsz entry point means: its default stream is the per-thread one. */
CUstream fc_ptsz_stream(CUstream s);
int fc_capture_alloc(CUstream s, CUdeviceptr *dptr, size_t size, int dev);
int fc_capture_free(CUstream s, CUdeviceptr dptr);
int fc_graph_mem_free(CUdeviceptr dptr);
CUdeviceptr fc_graph_add(CUgraph g, int type, int dev, size_t size, CUdeviceptr dptr);
#define FC_GRANULARITY (2ULL << 20)

#endif
