/*
 * overhead.c - device memory no allocation call returns, as the real driver takes it (issue 24):
 *
 *  - a context costs FAKECUDA_CTX_BYTES (default 0; taken after FAKECUDA_CTX_SETUP_US of set-up) from its creation (cuCtxCreate*, the first
 *    cuDevicePrimaryCtxRetain) to its end (cuCtxDestroy, a detach to zero, the last primary
 *    release);
 *  - a module costs its __device__ globals: the sizes of its ELF image's `.nv.global*` sections,
 *    as a real cubin carries them, until cuModuleUnload or the end of its context;
 *  - the malloc heap (CU_LIMIT_MALLOC_HEAP_SIZE, 8 MiB by default) and the printf FIFO
 *    (CU_LIMIT_PRINTF_FIFO_SIZE, 1 MiB by default) are allocated when the first module is loaded
 *    into the context (the Programming Guide: "the actual memory allocation for the heap occurs
 *    when a module is loaded into the context"; a failure there is
 *    CUDA_ERROR_SHARED_OBJECT_INIT_FAILED), and cannot change once a module has been loaded (the
 *    fake has no kernel launches, so "after a launch that uses malloc" is "after a module load");
 *  - a library (cuLibraryLoadData, cuLibraryLoadFromFile; CUDA 12.0) is context-independent: it
 *    is loaded, as a module of its own, into every live context at the call and into every
 *    context created later, until cuLibraryUnload, with eager loading (CUDA_MODULE_LOADING=EAGER,
 *    or unset before driver 12.2). Lazy loading (LAZY, or unset from 12.2 on: the real driver's
 *    default) loads a library into a context only when a function of it is first needed there,
 *    which in the fake (no launches) is never. A copy that
 *    does not fit fails the load (CUDA_ERROR_OUT_OF_MEMORY, nothing left loaded), or the
 *    context's creation;
 *  - CU_LIMIT_STACK_SIZE "takes effect immediately": the stack above the 1 KiB default costs the
 *    difference times the threads the device holds resident (FC_SM_COUNT multiprocessors of
 *    FC_THREADS_PER_SM, as cuDeviceGetAttribute says), from cuCtxSetLimit on.
 * Everything goes through fc_mem_overhead: cuMemGetInfo, fakecuda_stats, the shared device
 * counters and the fake NVML's per-process list all see it. A primary reset gives back all but
 * the context itself (modules, heap, FIFO, stack) and puts the limits back to their defaults.
 */
#define _GNU_SOURCE
#include <elf.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define FC_STACK_THREADS ((unsigned long long)FC_SM_COUNT * FC_THREADS_PER_SM)
#define DEFAULT_STACK 1024ULL
#define DEFAULT_HEAP (8ULL << 20)
#define DEFAULT_FIFO (1ULL << 20)

struct fc_module {
    struct fc_ctx *ctx;
    unsigned long long bytes;
    int unloaded;
    struct fc_library *lib;     /* the library this is its copy in ctx of, or NULL */
    struct fc_module *next;     /* registry: never freed, so a stale handle is detected */
};

struct fc_library {
    unsigned long long globals;
    int unloaded;
    int lazy;                   /* loaded lazily: into no context until first needed (never here) */
    struct fc_library *next;    /* registry: never freed, so a stale handle is detected */
};

/* Context overhead fields and the module and library registries. */
static pthread_mutex_t g_overhead_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fc_module *g_modules;
static struct fc_library *g_libraries;

static CUresult load_into(struct fc_ctx *c, unsigned long long globals, struct fc_library *lib, struct fc_module **out);
static void drop_modules(struct fc_ctx *c);

static unsigned long long limit_of(struct fc_ctx *c, int which, unsigned long long dflt)
{
    return c->limits[which] ? c->limits[which] : dflt;
}

CUresult fc_ctx_begin(struct fc_ctx *c)
{
    if (fc_cfg.ctx_setup_us > 0)
        usleep((useconds_t)fc_cfg.ctx_setup_us);
    pthread_mutex_lock(&g_overhead_lock);
    c->ctx_bytes = c->module_bytes = c->heap_bytes = c->stack_bytes = 0;
    c->modules = 0;
    memset(c->limits, 0, sizeof c->limits);
    if (fc_cfg.ctx_bytes && fc_mem_overhead(c->dev, (long long)fc_cfg.ctx_bytes) != 0) {
        pthread_mutex_unlock(&g_overhead_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    c->ctx_bytes = fc_cfg.ctx_bytes;
    /* Every library loaded and not unloaded is loaded into a new context at its creation. */
    for (struct fc_library *l = g_libraries; l; l = l->next)
        if (!l->unloaded && !l->lazy && load_into(c, l->globals, l, NULL) != CUDA_SUCCESS) {
            drop_modules(c);
            fc_mem_overhead(c->dev, -(long long)c->ctx_bytes);
            c->ctx_bytes = 0;
            pthread_mutex_unlock(&g_overhead_lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    pthread_mutex_unlock(&g_overhead_lock);
    /* The memory is the context's from here on, while it is still being made. */
    if (fc_cfg.ctx_delay_us > 0)
        usleep((useconds_t)fc_cfg.ctx_delay_us);
    return CUDA_SUCCESS;
}

/* Under g_overhead_lock: modules (and what they brought: heap, FIFO) and the stack go. */
static void drop_modules(struct fc_ctx *c)
{
    unsigned long long back = c->module_bytes + c->heap_bytes + c->stack_bytes;
    struct fc_module *m;

    for (m = g_modules; m; m = m->next)
        if (m->ctx == c && !m->unloaded)
            m->unloaded = 1;
    if (back)
        fc_mem_overhead(c->dev, -(long long)back);
    c->module_bytes = c->heap_bytes = c->stack_bytes = 0;
    c->modules = 0;
    memset(c->limits, 0, sizeof c->limits);
}

void fc_ctx_reset_modules(struct fc_ctx *c)
{
    pthread_mutex_lock(&g_overhead_lock);
    drop_modules(c);
    pthread_mutex_unlock(&g_overhead_lock);
}

void fc_ctx_finish(struct fc_ctx *c)
{
    pthread_mutex_lock(&g_overhead_lock);
    drop_modules(c);
    if (c->ctx_bytes)
        fc_mem_overhead(c->dev, -(long long)c->ctx_bytes);
    c->ctx_bytes = 0;
    pthread_mutex_unlock(&g_overhead_lock);
}

/* Sum of the sizes of an ELF64 image's sections named .nv.global or .nv.global.*; -1: not an
 * ELF64 image the fake can read (`len`: bytes known to be readable, 0 = trust the headers, as the
 * driver trusts a cuModuleLoadData image). */
static long long elf_globals(const unsigned char *img, size_t len)
{
    const Elf64_Ehdr *eh = (const void *)img;
    const Elf64_Shdr *sh, *strtab;
    unsigned long long sum = 0;

    if (!img || (len && len < sizeof *eh) || memcmp(img, ELFMAG, SELFMAG) != 0 || img[EI_CLASS] != ELFCLASS64)
        return -1;
    if (eh->e_shentsize != sizeof(Elf64_Shdr) || eh->e_shstrndx >= eh->e_shnum)
        return -1;
    if (len && eh->e_shoff + (unsigned long long)eh->e_shnum * sizeof *sh > len)
        return -1;
    sh = (const void *)(img + eh->e_shoff);
    strtab = &sh[eh->e_shstrndx];
    for (int i = 0; i < eh->e_shnum; i++) {
        const char *name;
        if (len && strtab->sh_offset + sh[i].sh_name >= len)
            return -1;
        name = (const char *)img + strtab->sh_offset + sh[i].sh_name;
        if (strncmp(name, ".nv.global", 10) == 0 && (name[10] == '\0' || name[10] == '.'))
            sum += sh[i].sh_size;
    }
    return (long long)sum;
}

/* Under g_overhead_lock: a module of `globals` bytes loaded into c (the first brings the heap and
 * FIFO); `out` (may be NULL) gets it. */
static CUresult load_into(struct fc_ctx *c, unsigned long long globals, struct fc_library *lib, struct fc_module **out)
{
    struct fc_module *m;
    unsigned long long first = 0;

    if (!(m = calloc(1, sizeof *m)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (c->modules == 0 && c->heap_bytes == 0) {   /* once per context: it stays after unloads */
        first = limit_of(c, CU_LIMIT_MALLOC_HEAP_SIZE, DEFAULT_HEAP) + limit_of(c, CU_LIMIT_PRINTF_FIFO_SIZE, DEFAULT_FIFO);
        if (fc_mem_overhead(c->dev, (long long)first) != 0) {
            free(m);
            return CUDA_ERROR_SHARED_OBJECT_INIT_FAILED;
        }
    }
    if (globals && fc_mem_overhead(c->dev, (long long)globals) != 0) {
        if (first)
            fc_mem_overhead(c->dev, -(long long)first);
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    c->heap_bytes += first;
    c->module_bytes += globals;
    c->modules++;
    m->ctx = c;
    m->bytes = globals;
    m->lib = lib;
    m->next = g_modules;
    g_modules = m;
    if (out)
        *out = m;
    return CUDA_SUCCESS;
}

/* Under g_overhead_lock: module m unloaded (its globals back; the heap stays with its context). */
static void unload_one(struct fc_module *m)
{
    m->unloaded = 1;
    m->ctx->module_bytes -= m->bytes;
    m->ctx->modules--;
    if (m->bytes)
        fc_mem_overhead(m->ctx->dev, -(long long)m->bytes);
}

static CUresult load(CUmodule *out, const unsigned char *img, size_t len)
{
    struct fc_ctx *c;
    struct fc_module *m = NULL;
    long long globals;
    CUresult rc;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!out || !img)
        return CUDA_ERROR_INVALID_VALUE;
    if (!(c = fc_current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    if ((globals = elf_globals(img, len)) < 0)
        return CUDA_ERROR_INVALID_IMAGE;
    pthread_mutex_lock(&g_overhead_lock);
    rc = load_into(c, (unsigned long long)globals, NULL, &m);
    pthread_mutex_unlock(&g_overhead_lock);
    if (rc == CUDA_SUCCESS)
        *out = m;
    return rc;
}

FC_API CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    FC_COUNT(cuModuleLoadData);
    return load(module, image, 0);
}

FC_API CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options,
                                   void **optionValues)
{
    FC_COUNT(cuModuleLoadDataEx);
    if (numOptions && (!options || !optionValues))
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return load(module, image, 0);
}

FC_API CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    FC_COUNT(cuModuleLoadFatBinary);
    return load(module, fatCubin, 0);
}

/* A whole file's bytes (free them), or the driver's error for a file it cannot load. */
static CUresult slurp(const char *fname, unsigned char **buf, size_t *len)
{
    struct stat st;
    ssize_t got;
    int fd;

    if ((fd = open(fname, O_RDONLY | O_CLOEXEC)) < 0)
        return CUDA_ERROR_FILE_NOT_FOUND;
    if (fstat(fd, &st) != 0 || st.st_size <= 0 || !(*buf = malloc((size_t)st.st_size))) {
        close(fd);
        return CUDA_ERROR_INVALID_IMAGE;
    }
    got = read(fd, *buf, (size_t)st.st_size);
    close(fd);
    if (got != st.st_size) {
        free(*buf);
        return CUDA_ERROR_INVALID_IMAGE;
    }
    *len = (size_t)got;
    return CUDA_SUCCESS;
}

FC_API CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    unsigned char *buf;
    size_t len;
    CUresult rc;

    FC_COUNT(cuModuleLoad);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!module || !fname)
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = slurp(fname, &buf, &len)) != CUDA_SUCCESS)
        return rc;
    rc = load(module, buf, len);
    free(buf);
    return rc;
}

FC_API CUresult cuModuleUnload(CUmodule hmod)
{
    struct fc_module *m;

    FC_COUNT(cuModuleUnload);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_overhead_lock);
    for (m = g_modules; m && m != hmod; m = m->next)
        ;
    if (!m || m->unloaded) {
        pthread_mutex_unlock(&g_overhead_lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (m->lib) {               /* a library's copy goes with the library, not on its own */
        pthread_mutex_unlock(&g_overhead_lock);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    unload_one(m);
    pthread_mutex_unlock(&g_overhead_lock);
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    struct fc_ctx *c;
    CUresult rc = CUDA_SUCCESS;

    FC_COUNT(cuCtxSetLimit);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (limit < 0 || limit > CU_LIMIT_PERSISTING_L2_CACHE_SIZE)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    if (!(c = fc_current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_overhead_lock);
    if ((limit == CU_LIMIT_MALLOC_HEAP_SIZE || limit == CU_LIMIT_PRINTF_FIFO_SIZE) && (c->modules > 0 || c->heap_bytes > 0)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (limit == CU_LIMIT_STACK_SIZE) {
        unsigned long long want = value > DEFAULT_STACK ? (value - DEFAULT_STACK) * FC_STACK_THREADS : 0;
        long long delta = (long long)want - (long long)c->stack_bytes;
        if (fc_mem_overhead(c->dev, delta) != 0)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        else
            c->stack_bytes = want;
    }
    if (rc == CUDA_SUCCESS)
        c->limits[limit] = value;
    pthread_mutex_unlock(&g_overhead_lock);
    return rc;
}

FC_API CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit)
{
    static const unsigned long long dflt[7] = {DEFAULT_STACK, DEFAULT_FIFO, DEFAULT_HEAP, 2, 2048, 64, 0};
    struct fc_ctx *c;

    FC_COUNT(cuCtxGetLimit);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pvalue)
        return CUDA_ERROR_INVALID_VALUE;
    if (limit < 0 || limit > CU_LIMIT_PERSISTING_L2_CACHE_SIZE)
        return CUDA_ERROR_UNSUPPORTED_LIMIT;
    if (!(c = fc_current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_overhead_lock);
    *pvalue = limit_of(c, limit, dflt[limit]);
    pthread_mutex_unlock(&g_overhead_lock);
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- libraries */

/* Under g_overhead_lock: every copy of lib goes (its globals; heaps stay with their contexts). */
static void unload_library(struct fc_library *lib)
{
    for (struct fc_module *m = g_modules; m; m = m->next)
        if (m->lib == lib && !m->unloaded)
            unload_one(m);
    lib->unloaded = 1;
}

/* fc_ctx_each_live callback: a copy of the library into one live context. */
static CUresult load_copy(struct fc_ctx *c, void *arg)
{
    struct fc_library *lib = arg;
    CUresult rc;

    pthread_mutex_lock(&g_overhead_lock);
    /* A context being destroyed meanwhile is skipped: its end drops what it holds anyway. */
    rc = atomic_load(&c->destroyed) ? CUDA_SUCCESS : load_into(c, lib->globals, lib, NULL);
    pthread_mutex_unlock(&g_overhead_lock);
    return rc;
}

/* Options come in (array, values, count) triples: a count without its arrays is invalid. */
static int options_ok(const void *opts, void **values, unsigned int n)
{
    return n == 0 || (opts && values);
}

/* CUDA_MODULE_LOADING: EAGER or LAZY; unset, LAZY from driver 12.2 on (its default on Linux since
 * CUDA 12.2, Programming Guide "Lazy Loading"), EAGER before. */
static int lazy_loading(void)
{
    const char *v = getenv("CUDA_MODULE_LOADING");
    if (v && *v)
        return strcmp(v, "LAZY") == 0;
    return fc_cfg.driver_version >= 12020;
}

static CUresult library_load(CUlibrary *out, const unsigned char *img, size_t len)
{
    struct fc_library *lib;
    long long globals;
    CUresult rc;

    if ((globals = elf_globals(img, len)) < 0)
        return CUDA_ERROR_INVALID_IMAGE;
    if (!(lib = calloc(1, sizeof *lib)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    lib->globals = (unsigned long long)globals;
    lib->lazy = lazy_loading();
    /* Context-independent: into every live context now (eager loading), later ones at their
     * creation (fc_ctx_begin). The registry lock keeps contexts from beginning meanwhile.
     * CUDA_MODULE_LOADING=LAZY (the default on Linux since CUDA 12.2, Programming Guide "Lazy
     * Loading"): into a context only when a function of it is first needed there, which in the
     * fake (no launches) is never; the library is still loaded. */
    rc = lazy_loading() ? CUDA_SUCCESS : fc_ctx_each_live(load_copy, lib);
    pthread_mutex_lock(&g_overhead_lock);
    if (rc != CUDA_SUCCESS) {
        unload_library(lib);
    } else {
        lib->next = g_libraries;
        g_libraries = lib;
    }
    pthread_mutex_unlock(&g_overhead_lock);
    if (rc != CUDA_SUCCESS)
        return rc == CUDA_ERROR_SHARED_OBJECT_INIT_FAILED ? rc : CUDA_ERROR_OUT_OF_MEMORY;
    *out = lib;
    return CUDA_SUCCESS;
}

FC_API CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions, void **jitOptionsValues,
                                  unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                  unsigned int numLibraryOptions)
{
    FC_COUNT(cuLibraryLoadData);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!library || !code || !options_ok(jitOptions, jitOptionsValues, numJitOptions) ||
        !options_ok(libraryOptions, libraryOptionValues, numLibraryOptions))
        return CUDA_ERROR_INVALID_VALUE;
    return library_load(library, code, 0);
}

FC_API CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                      void **jitOptionsValues, unsigned int numJitOptions,
                                      CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                      unsigned int numLibraryOptions)
{
    unsigned char *buf;
    size_t len;
    CUresult rc;

    FC_COUNT(cuLibraryLoadFromFile);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!library || !fileName || !options_ok(jitOptions, jitOptionsValues, numJitOptions) ||
        !options_ok(libraryOptions, libraryOptionValues, numLibraryOptions))
        return CUDA_ERROR_INVALID_VALUE;
    if ((rc = slurp(fileName, &buf, &len)) != CUDA_SUCCESS)
        return rc;
    rc = library_load(library, buf, len);
    free(buf);
    return rc;
}

/* Documented errors: CUDA_ERROR_INVALID_VALUE for a library that is not loaded. */
FC_API CUresult cuLibraryUnload(CUlibrary library)
{
    struct fc_library *l;

    FC_COUNT(cuLibraryUnload);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_overhead_lock);
    for (l = g_libraries; l && l != library; l = l->next)
        ;
    if (!l || l->unloaded) {
        pthread_mutex_unlock(&g_overhead_lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    unload_library(l);
    pthread_mutex_unlock(&g_overhead_lock);
    return CUDA_SUCCESS;
}
