/* client_linked: driver functions bound by the dynamic linker (-lcuda), the
 * way an application linked against libcuda sees them. */
#include "client.h"

int main(int argc, char **argv)
{
    struct cu_api api = {
        .cuInit = cuInit,
        .cuDevicePrimaryCtxRetain = cuDevicePrimaryCtxRetain,
        .cuCtxSetCurrent = cuCtxSetCurrent,
        .cuCtxGetCurrent = cuCtxGetCurrent,
        .cuMemAlloc_v2 = cuMemAlloc_v2,
        .cuMemFree_v2 = cuMemFree_v2,
        .cuMemAlloc = cuMemAlloc,
        .cuMemFree = cuMemFree,
        .cuMemGetInfo_v2 = cuMemGetInfo_v2,
        .cuMemGetInfo = cuMemGetInfo,
        .cuDeviceTotalMem_v2 = cuDeviceTotalMem_v2,
        .cuDriverGetVersion = cuDriverGetVersion,
#define SET(name, base, ver, flags) .name = name,
        CLIENT_EXTRA(SET)
        CLIENT_CTX(SET)
        CLIENT_POOL(SET)
        CLIENT_MANAGED(SET)
#undef SET
    };
    return client_run(&api, argc, argv);
}
