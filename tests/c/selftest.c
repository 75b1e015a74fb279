/*
 * selftest: checks of the fake driver's own semantics (not of vramcap):
 * cuGetProcAddress rules, pre-init behaviour, contexts, UUIDs, failure
 * injection and the test-only counters.  Run without any LD_PRELOAD:
 *   LD_LIBRARY_PATH=target/cuda-shim target/ctests/selftest
 * Prints "selftest ok" and exits 0, or names the first failed check.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_types.h"
#include "fakecuda.h"

static int failures;

#define CHECK(cond)                                                   \
    do {                                                              \
        if (!(cond)) {                                                \
            fprintf(stderr, "selftest: %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                               \
        }                                                             \
    } while (0)

static void *H;

static void *gp(const char *name, int ver, cuuint64_t flags, CUresult *rc, int *st)
{
    void *p = (void *)1;
    *st = -1;
    *rc = cuGetProcAddress_v2(name, &p, ver, flags, st);
    return p;
}

int main(void)
{
    CUresult rc;
    int st, v, n;
    void *p;
    CUcontext c0, c1, c;
    CUdevice d;
    CUdeviceptr a, b;
    CUuuid u;
    size_t fr, tot;
    fakecuda_stats_t s;
    const char *str;
    char buf[64];

    H = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(H != NULL);

    /* Before cuInit: lookups and the version work, the rest does not. */
    p = gp("cuMemAlloc", 3020, 0, &rc, &st);
    CHECK(rc == CUDA_SUCCESS && st == 0 && p == dlsym(H, "cuMemAlloc_v2"));
    CHECK(cuDriverGetVersion(&v) == CUDA_SUCCESS && v == 13050);
    CHECK(cuDeviceGetCount(&n) == CUDA_ERROR_NOT_INITIALIZED);
    CHECK(cuMemAlloc_v2(&a, 256) == CUDA_ERROR_NOT_INITIALIZED);

    /* cuGetProcAddress rules. */
    p = gp("cuMemAlloc", 2000, 0, &rc, &st);
    CHECK(rc == 0 && st == 0 && p == dlsym(H, "cuMemAlloc"));
    p = gp("cuMemAlloc", 13000, 2, &rc, &st);
    CHECK(rc == 0 && st == 0 && p == dlsym(H, "cuMemAlloc_v2"));
    p = gp("cuMemcpyHtoD", 7000, 2, &rc, &st);
    CHECK(rc == 0 && st == 0 && p == dlsym(H, "cuMemcpyHtoD_v2_ptds"));
    p = gp("cuMemcpyHtoD", 6050, 2, &rc, &st);
    CHECK(rc == 0 && st == 0 && p == dlsym(H, "cuMemcpyHtoD_v2"));
    p = gp("cuMemcpyHtoD", 12000, 0, &rc, &st);
    CHECK(rc == 0 && st == 0 && p == dlsym(H, "cuMemcpyHtoD_v2"));
    p = gp("cuCtxGetDevice", 12090, 0, &rc, &st);
    CHECK(rc == 0 && p == dlsym(H, "cuCtxGetDevice"));
    p = gp("cuCtxGetDevice", 13000, 0, &rc, &st);
    CHECK(rc == 0 && p == dlsym(H, "cuCtxGetDevice_v2"));
    p = gp("cuDevicePrimaryCtxRelease", 11000, 0, &rc, &st);
    CHECK(rc == 0 && p == dlsym(H, "cuDevicePrimaryCtxRelease_v2"));
    p = gp("cuDeviceGetUuid", 9000, 0, &rc, &st);
    CHECK(rc == 0 && st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT && p == NULL);
    p = gp("cuNoSuchThing", 12000, 0, &rc, &st);
    CHECK(rc == 0 && st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND && p == NULL);
    p = gp("", 12000, 0, &rc, &st);
    CHECK(rc == 0 && st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND && p == NULL);
    p = gp("cuMemAlloc_v2", 12000, 0, &rc, &st);   /* exported, but not a base name */
    CHECK(rc == 0 && st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND && p == NULL);
    gp("cuMemAlloc", 13060, 0, &rc, &st);
    CHECK(rc == CUDA_ERROR_INVALID_VALUE);
    CHECK(cuGetProcAddress_v2(NULL, &p, 12000, 0, NULL) == CUDA_ERROR_INVALID_VALUE);
    CHECK(cuGetProcAddress_v2("cuInit", NULL, 12000, 0, NULL) == CUDA_ERROR_INVALID_VALUE);
    CHECK(cuGetProcAddress("cuInit", &p, 11030, 0) == 0 && p == dlsym(H, "cuInit"));
    p = (void *)1;
    CHECK(cuGetExportTable((const void **)&p, NULL) == CUDA_ERROR_NOT_FOUND && p == NULL);
    CHECK(cuGetExportTable(NULL, NULL) == CUDA_ERROR_NOT_FOUND);

    /* Devices. */
    CHECK(cuInit(0) == CUDA_SUCCESS);
    CHECK(cuDeviceGetCount(&n) == 0 && n == 2);
    CHECK(cuDeviceGet(&d, 1) == 0 && d == 1);
    CHECK(cuDeviceGet(&d, 2) == CUDA_ERROR_INVALID_DEVICE);
    CHECK(cuDeviceGet(NULL, 0) == CUDA_ERROR_INVALID_VALUE);
    CHECK(cuDeviceGetUuid(&u, 0) == 0 && !memcmp(u.bytes, "\x89\x32\xf9\x37", 4));
    CHECK(cuDeviceGetUuid_v2(&u, 1) == 0 && !memcmp(u.bytes, "\x89\x32\xf9\x38", 4));
    CHECK(cuDeviceGetName(buf, sizeof buf, 0) == 0 && buf[0]);
    CHECK(cuDeviceGetPCIBusId(buf, sizeof buf, 1) == 0 && !strcmp(buf, "0000:11:00.0"));
    CHECK(cuDeviceGetAttribute(&v, 75, 0) == 0 && v == 9);
    CHECK(cuDeviceGetAttribute(&v, 9999, 0) == 0 && v == 0);
    CHECK(cuGetErrorName(2, &str) == 0 && !strcmp(str, "CUDA_ERROR_OUT_OF_MEMORY"));
    CHECK(cuGetErrorString(12345, &str) == CUDA_ERROR_INVALID_VALUE && str == NULL);

    /* Contexts. */
    CHECK(cuMemAlloc_v2(&a, 256) == CUDA_ERROR_INVALID_CONTEXT);
    CHECK(cuMemGetInfo_v2(&fr, &tot) == CUDA_ERROR_INVALID_CONTEXT);
    CHECK(cuDevicePrimaryCtxRetain(&c0, 0) == 0);
    CHECK(cuCtxCreate_v2(&c1, 0, 1) == 0);                 /* pushed */
    CHECK(cuCtxGetDevice(&d) == 0 && d == 1);
    CHECK(cuCtxPushCurrent_v2(c0) == 0);
    CHECK(cuCtxGetDevice(&d) == 0 && d == 0);
    CHECK(cuCtxGetDevice_v2(&d, c1) == 0 && d == 1);
    CHECK(cuCtxPopCurrent_v2(&c) == 0 && c == c0);
    CHECK(cuCtxGetCurrent(&c) == 0 && c == c1);
    CHECK(cuMemAlloc_v2(&a, 1000) == 0 && (a & 255) == 0);
    CHECK(fakecuda_stats(1, &s) == 0 && s.bytes_held == 1000 && s.live_allocs == 1);
    CHECK(cuCtxSetCurrent(c0) == 0);
    CHECK(cuMemFree_v2(a) == 0);                            /* cross-device free is fine */
    CHECK(cuMemFree_v2(a) == CUDA_ERROR_INVALID_VALUE);     /* double free */
    CHECK(cuMemFree_v2(a + 256) == CUDA_ERROR_INVALID_VALUE);
    CHECK(fakecuda_stats(1, &s) == 0 && s.bytes_held == 0 && s.free_calls == 3);
    CHECK(cuCtxDestroy_v2(c1) == 0);
    CHECK(cuCtxDestroy_v2(c1) == CUDA_ERROR_INVALID_CONTEXT);

    /* Memory contents round-trip through host memory. */
    CHECK(cuMemAlloc_v2(&a, 3 << 20) == 0);
    CHECK(cuMemsetD8_v2(a, 0xab, 3 << 20) == 0 && ((unsigned char *)(uintptr_t)a)[(3 << 20) - 1] == 0xab);
    CHECK(cuMemcpyHtoD_v2_ptds(a, "hello", 6) == 0);
    CHECK(cuMemcpyDtoH_v2(buf, a, 6) == 0 && !strcmp(buf, "hello"));
    CHECK(cuMemFree_v2(a) == 0);
    CHECK(cuMemAlloc_v2(&a, 0) == CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemAlloc_v2(NULL, 1) == CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemAlloc_v2(&a, (16ULL << 30) + 1) == CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(cuMemAlloc_v2(&a, 16ULL << 30) == 0 && cuMemGetInfo_v2(&fr, &tot) == 0 && fr == 0);
    CHECK(cuMemAlloc_v2(&b, 1) == CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(cuMemFree_v2(a) == 0);

    /* Failure injection and counters. */
    fakecuda_fail_nth_alloc(2, 999);
    CHECK(cuMemAlloc_v2(&a, 256) == 0);
    CHECK(cuMemAlloc_v2(&b, 256) == 999);
    CHECK(cuMemAlloc_v2(&b, 256) == 0);
    CHECK(cuMemFree_v2(a) == 0 && cuMemFree_v2(b) == 0);
    CHECK(fakecuda_calls("cuMemcpyHtoD_v2_ptds") == 1);
    CHECK(fakecuda_calls("cuMemcpyHtoD_v2") == 0);
    CHECK(fakecuda_calls("cuInit") == 1);
    CHECK(fakecuda_calls("nope") == 0 && fakecuda_calls(NULL) == 0);
    CHECK(fakecuda_stats(16, &s) == -1);

    if (failures) {
        fprintf(stderr, "selftest: %d failure(s)\n", failures);
        return 1;
    }
    printf("selftest ok\n");
    return 0;
}
