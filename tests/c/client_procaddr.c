/* client_procaddr: the CUDA runtime's way.  dlopen libcuda.so.1 privately,
 * dlsym only cuGetProcAddress_v2, and resolve every function by BASE name and
 * the CUDA version of the ABI wanted (cuMemAlloc @3020 = _v2, @2000 = v1). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

#include "client.h"

static CUresult (*get_proc)(const char *, void **, int, cuuint64_t,
                            CUdriverProcAddressQueryResult *);

static void *proc_flags(const char *base, int version, cuuint64_t flags)
{
    void *p = NULL;
    CUdriverProcAddressQueryResult st = -1;
    CUresult rc = get_proc(base, &p, version, flags, &st);

    if (rc != CUDA_SUCCESS || st != CU_GET_PROC_ADDRESS_SUCCESS || !p) {
        fprintf(stderr, "client: cuGetProcAddress_v2(%s, %d) rc=%d status=%d\n",
                base, version, rc, st);
        client_need(NULL, base);
    }
    return p;
}

static void *proc(const char *base, int version)
{
    return proc_flags(base, version, CU_GET_PROC_ADDRESS_DEFAULT);
}

int main(int argc, char **argv)
{
    struct cu_api api;
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

    if (!h) {
        fprintf(stderr, "client: dlopen libcuda.so.1: %s\n", dlerror());
        return 3;
    }
    *(void **)&get_proc = dlsym(h, "cuGetProcAddress_v2");
    client_need((void *)get_proc, "cuGetProcAddress_v2");
#define GET(f, base, ver) *(void **)&api.f = proc(base, ver)
    GET(cuInit, "cuInit", 2000);
    GET(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 7000);
    GET(cuCtxSetCurrent, "cuCtxSetCurrent", 4000);
    GET(cuCtxGetCurrent, "cuCtxGetCurrent", 4000);
    GET(cuMemAlloc_v2, "cuMemAlloc", 3020);
    GET(cuMemFree_v2, "cuMemFree", 3020);
    GET(cuMemAlloc, "cuMemAlloc", 2000);
    GET(cuMemFree, "cuMemFree", 2000);
    GET(cuMemGetInfo_v2, "cuMemGetInfo", 3020);
    GET(cuMemGetInfo, "cuMemGetInfo", 2000);
    GET(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 3020);
    GET(cuDriverGetVersion, "cuDriverGetVersion", 2020);
#undef GET
    /* flags 2 = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: the _ptsz variants. */
#define GET(name, base, ver, flags) *(void **)&api.name = proc_flags(base, ver, flags);
    CLIENT_EXTRA(GET)
    CLIENT_CTX(GET)
    CLIENT_POOL(GET)
    CLIENT_MANAGED(GET)
#undef GET
    return client_run(&api, argc, argv);
}
