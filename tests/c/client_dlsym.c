/* client_dlsym: driver functions from dlsym on a private (RTLD_LOCAL)
 * libcuda.so.1 handle by exported name, as TensorFlow/XLA and cuBLASLt do. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

#include "client.h"

static void *h;

static void *sym(const char *name)
{
    void *p = dlsym(h, name);
    client_need(p, name);
    return p;
}

int main(int argc, char **argv)
{
    struct cu_api api;

    h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "client: dlopen libcuda.so.1: %s\n", dlerror());
        return 3;
    }
#define GET(f) *(void **)&api.f = sym(#f)
    GET(cuInit);
    GET(cuDevicePrimaryCtxRetain);
    GET(cuCtxSetCurrent);
    GET(cuCtxGetCurrent);
    GET(cuMemAlloc_v2);
    GET(cuMemFree_v2);
    GET(cuMemAlloc);
    GET(cuMemFree);
    GET(cuMemGetInfo_v2);
    GET(cuMemGetInfo);
    GET(cuDeviceTotalMem_v2);
    GET(cuDriverGetVersion);
#undef GET
#define GET(name, base, ver, flags) *(void **)&api.name = sym(#name);
    CLIENT_EXTRA(GET)
    CLIENT_CTX(GET)
    CLIENT_POOL(GET)
    CLIENT_MANAGED(GET)
#undef GET
    return client_run(&api, argc, argv);
}
