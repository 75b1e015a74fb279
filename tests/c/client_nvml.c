/* client_nvml: NVML's memory view next to CUDA's, NVML reached by linking (-lnvidia-ml) and by
 * dlsym on a private libnvidia-ml.so.1 handle.
 *   init | ctx DEV | alloc SIZE_MIB | cuinfo
 *   cucount                                     -> cucount rc=N (cuDeviceGetCount: 3 before cuInit)
 *   nvml I | nvml2 I | nvmlsym I | nvmlnull I   -> nvml rc=N total=T free=F used=U (NVML index I) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_types.h"

typedef void *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
int nvmlInit_v2(void);
int nvmlDeviceGetHandleByIndex_v2(unsigned int, nvmlDevice_t *);
int nvmlDeviceGetMemoryInfo(nvmlDevice_t, nvmlMemory_t *);
int nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t, nvmlMemory_v2_t *);

int main(int argc, char **argv)
{
    CUcontext c;
    CUdeviceptr p;

    if (nvmlInit_v2() != 0) {
        fprintf(stderr, "client_nvml: nvmlInit_v2 failed\n");
        return 3;
    }
    for (int i = 1; i < argc; i++) {
        const char *op = argv[i];
        nvmlDevice_t d = NULL;
        nvmlMemory_t m = { 0, 0, 0 };
        nvmlMemory_v2_t m2 = { (unsigned int)(sizeof m2 | (2u << 24)), 0, 0, 0, 0 };
        int rc;

        if (!strcmp(op, "init")) {
            printf("init rc=%d\n", cuInit(0));
        } else if (!strcmp(op, "ctx")) {
            rc = cuDevicePrimaryCtxRetain(&c, atoi(argv[++i]));
            printf("ctx rc=%d\n", rc ? rc : cuCtxSetCurrent(c));
        } else if (!strcmp(op, "alloc")) {
            printf("alloc rc=%d\n", cuMemAlloc_v2(&p, (size_t)atoll(argv[++i]) << 20));
        } else if (!strcmp(op, "cucount")) {
            int n = 0;
            printf("cucount rc=%d\n", cuDeviceGetCount(&n));
        } else if (!strcmp(op, "cuinfo")) {
            size_t f = 0, t = 0;
            rc = cuMemGetInfo_v2(&f, &t);
            printf("cuinfo rc=%d free=%zu total=%zu\n", rc, f, t);
        } else if (!strcmp(op, "nvml") || !strcmp(op, "nvml2") || !strcmp(op, "nvmlsym") || !strcmp(op, "nvmlnull")) {
            nvmlDeviceGetHandleByIndex_v2((unsigned int)atoi(argv[++i]), &d);
            if (!strcmp(op, "nvml")) {
                rc = nvmlDeviceGetMemoryInfo(d, &m);
            } else if (!strcmp(op, "nvml2")) {
                rc = nvmlDeviceGetMemoryInfo_v2(d, &m2);
                m.total = m2.total, m.free = m2.free, m.used = m2.used;
            } else if (!strcmp(op, "nvmlnull")) {
                rc = nvmlDeviceGetMemoryInfo(d, NULL);
            } else {
                void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
                int (*f)(nvmlDevice_t, nvmlMemory_t *);
                *(void **)&f = h ? dlsym(h, "nvmlDeviceGetMemoryInfo") : NULL;
                rc = f ? f(d, &m) : -1;
            }
            printf("nvml rc=%d total=%llu free=%llu used=%llu\n", rc, m.total, m.free, m.used);
        } else {
            fprintf(stderr, "client_nvml: unknown op '%s'\n", op);
            return 2;
        }
        fflush(stdout);
    }
    return 0;
}
