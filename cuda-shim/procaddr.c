/*
 * procaddr.c - cuGetProcAddress and cuGetExportTable.
 *
 * The CUDA runtime does not dlsym driver functions: it asks
 * cuGetProcAddress_v2 for a BASE name plus the CUDA version whose ABI it was
 * compiled against, and the driver picks the newest variant not newer than
 * that version (e.g. "cuMemAlloc" @ 2000 -> cuMemAlloc, @ 3020 ->
 * cuMemAlloc_v2).  An interposer must get this right, so the fake implements
 * the documented rules over the same list that defines its exports
 * (entrypoints.def).  The pointers handed out are the exported symbols'
 * addresses (linked with -Bsymbolic, so they equal what dlsym returns).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct proc_entry {
    const char *base;
    const char *sym;
    int since;
    int per_thread;
    void *fn;
};

static const struct proc_entry g_procs[] = {
#define EP(base, sym, since, ptds) { #base, #sym, since, ptds, (void *)&sym },
#include "entrypoints.def"
#undef EP
};

/* Whether this copy of the driver exports `sym`: the variants built with a link map
 * (old-driver.map, pre-12.8-driver.map, no-stream-device.map) keep some entry points unexported,
 * and a driver never hands out through cuGetProcAddress what it does not have. Looked up on our
 * own handle (RTLD_NOLOAD: the library is loaded, we are in it). */
static int exported(const char *sym)
{
    static void *self;
    Dl_info info;

    if (!self && dladdr((void *)&exported, &info) && info.dli_fname)
        self = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    return !self || dlsym(self, sym) != NULL;
}

/* FAKECUDA_NEW_ABI=NAME@VERSION: a test fixture for "a newer driver added an ABI": lookups of
 * NAME at VERSION or later answer with new_abi_alloc (cuMemAlloc_v2's arguments), a function no
 * interposer can know. Lets tests prove what an interposer does with an entry point it does not
 * wrap; NAME should be an allocating base name. Not a driver interface: never exported. */
static CUresult new_abi_alloc(CUdeviceptr *dptr, size_t size)
{
    return fc_mem_alloc_cur(dptr, size);
}

static int new_abi(const char *symbol, int cudaVersion)
{
    const char *v = getenv("FAKECUDA_NEW_ABI"), *at = v ? strchr(v, '@') : NULL;

    return at && (size_t)(at - v) == strlen(symbol) && !strncmp(v, symbol, (size_t)(at - v)) &&
           cudaVersion >= atoi(at + 1);
}

static CUresult get_proc(const char *symbol, void **pfn, int cudaVersion,
                         cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    const struct proc_entry *best = NULL, *best_pt = NULL, *pick;
    int known = 0;

    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    fc_config_load();           /* works before cuInit; needs the driver version */
    if (cudaVersion > fc_cfg.driver_version)
        return CUDA_ERROR_INVALID_VALUE;

    for (size_t i = 0; i < sizeof g_procs / sizeof g_procs[0]; i++) {
        const struct proc_entry *e = &g_procs[i];

        if (strcmp(e->base, symbol) != 0)
            continue;
        known = 1;
        if (e->since > cudaVersion || !exported(e->sym))
            continue;
        if (e->per_thread) {
            if (!best_pt || e->since > best_pt->since)
                best_pt = e;
        } else if (!best || e->since > best->since) {
            best = e;
        }
    }
    pick = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && best_pt ? best_pt : best;

    if (pick)
        *pfn = pick->fn;
    if (pick && new_abi(symbol, cudaVersion))
        *pfn = (void *)&new_abi_alloc;
    if (status)
        *status = pick ? CU_GET_PROC_ADDRESS_SUCCESS
                : known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                        : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    /* Documented: not found / version too old is still CUDA_SUCCESS with
     * *pfn == NULL; the status tells which. */
    return CUDA_SUCCESS;
}

FC_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                 cuuint64_t flags)
{
    FC_COUNT(cuGetProcAddress);
    return get_proc(symbol, pfn, cudaVersion, flags, NULL);
}

FC_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus)
{
    FC_COUNT(cuGetProcAddress_v2);
    return get_proc(symbol, pfn, cudaVersion, flags, symbolStatus);
}

/* The runtime probes private export tables; the fake has none, and says so
 * the one way callers are prepared for. */
FC_API CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId)
{
    (void)pExportTableId;
    FC_COUNT(cuGetExportTable);
    if (ppExportTable)
        *ppExportTable = NULL;
    return CUDA_ERROR_NOT_FOUND;
}
