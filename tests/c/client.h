/*
 * client.h - shared op interpreter of the C test clients.
 *
 * The three front ends (client_linked, client_dlsym, client_procaddr) differ
 * only in how they obtain the driver functions, because each way exercises a
 * different interception path of an LD_PRELOAD library.
 */
#ifndef VRAMCAP_TEST_CLIENT_H
#define VRAMCAP_TEST_CLIENT_H

#include "cuda_types.h"

struct cu_api {
    CUresult (*cuInit)(unsigned int);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuCtxGetCurrent)(CUcontext *);
    CUresult (*cuMemAlloc_v2)(CUdeviceptr *, size_t);
    CUresult (*cuMemFree_v2)(CUdeviceptr);
    CUresult (*cuMemAlloc)(CUdeviceptr_v1 *, unsigned int);   /* legacy 32-bit ABI */
    CUresult (*cuMemFree)(CUdeviceptr_v1);
    CUresult (*cuMemGetInfo_v2)(size_t *, size_t *);
    CUresult (*cuMemGetInfo)(unsigned int *, unsigned int *);
    CUresult (*cuDeviceTotalMem_v2)(size_t *, CUdevice);
    CUresult (*cuDriverGetVersion)(int *);
};

/* Runs the ops in argv[1..]; returns the process exit status. */
int client_run(const struct cu_api *api, int argc, char **argv);

/* For op families kept in their own files (ops_*.c). */
extern const struct cu_api *client_A;
void client_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
unsigned long long client_parse_size(const char *s);
long client_parse_long(const char *s);
/* Each returns 1 if it handled `op` (consuming its arguments via *i), else 0. */
int client_lifecycle_op(const char *op, int *i, int argc, char **argv);

/* Front-end helper: complain and exit when a function could not be resolved. */
void client_need(const void *fn, const char *what);

#endif
