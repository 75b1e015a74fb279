/*
 * nextwrap: a second LD_PRELOAD wrapper, like a profiler or ncu would be. It wraps two driver
 * functions and finds "the next definition" with dlsym(RTLD_NEXT, ...), which glibc resolves
 * relative to the *caller's* object. If vramcap's dlsym hook made itself the caller, this library
 * would get its own functions back and recurse forever.
 *
 * - cuDriverGetVersion: vramcap does not wrap it, so RTLD_NEXT from here must reach the driver.
 * - cuMemAlloc_v2: when this library comes before vramcap, RTLD_NEXT must reach vramcap's wrapper
 *   (so the cap still applies); after vramcap it must reach the driver.
 * At exit it prints how often each wrapper ran.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "cuda_types.h"

static int depth_version, calls_version, calls_alloc;

CUresult cuDriverGetVersion(int *v)
{
    static CUresult (*next)(int *);
    CUresult rc;
    if (!next)
        *(void **)&next = dlsym(RTLD_NEXT, "cuDriverGetVersion");
    if (!next)
        return 999;
    calls_version++;
    if (++depth_version > 3) {
        fprintf(stderr, "nextwrap: cuDriverGetVersion recursed: RTLD_NEXT found ourselves\n");
        _exit(42);
    }
    rc = next(v);
    depth_version--;
    return rc;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
    static CUresult (*next)(CUdeviceptr *, size_t);
    if (!next)
        *(void **)&next = dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    if (!next || (void *)next == (void *)cuMemAlloc_v2) {
        fprintf(stderr, "nextwrap: RTLD_NEXT gave back our own cuMemAlloc_v2\n");
        _exit(43);
    }
    calls_alloc++;
    return next(p, n);
}

__attribute__((destructor)) static void report(void)
{
    fprintf(stderr, "nextwrap: version_calls=%d alloc_calls=%d\n", calls_version, calls_alloc);
}
