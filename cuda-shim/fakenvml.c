/*
 * fakenvml.c - a fake libnvidia-ml.so.1 (public NVML API only) over the fake
 * driver: memory numbers come from fakecuda_stats, UUIDs and PCI bus ids match
 * the fake driver's cuDeviceGetUuid / cuDeviceGetPCIBusId. Like the real NVML it
 * never initialises CUDA (a process may ask NVML before, or without, cuInit).
 * FAKENVML_REVERSE=1 numbers devices in reverse order, so tests can prove NVML
 * handles are matched to CUDA ordinals by UUID or PCI bus and not by index.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_types.h"
#include "fakecuda.h"

#define API __attribute__((visibility("default")))
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_UNKNOWN 999

typedef struct { int index; } *nvmlDevice_t;   /* handle: points at a CUDA ordinal */
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
#define NVML_MEMORY_V2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

static struct { int index; } g_dev[16];
static int g_init;
static int (*g_stats)(int, fakecuda_stats_t *);
static int (*g_uuid)(int, unsigned char *);
static int (*g_bus)(int);
static int (*g_procs)(int, unsigned int *, unsigned long long *, int);
static int (*g_device_held)(int, unsigned long long *);

static int count(void)
{
    const char *v = getenv("FAKECUDA_DEVICE_COUNT");
    int n = v ? atoi(v) : 2;
    return n < 0 ? 0 : n > 16 ? 16 : n;
}

API int nvmlInit_v2(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

    if (!h)
        return NVML_ERROR_UNKNOWN;
    *(void **)&g_stats = dlsym(h, "fakecuda_stats");
    *(void **)&g_uuid = dlsym(h, "fakecuda_uuid");
    *(void **)&g_bus = dlsym(h, "fakecuda_pci_bus");
    *(void **)&g_procs = dlsym(h, "fakecuda_processes");
    *(void **)&g_device_held = dlsym(h, "fakecuda_device_held");
    if (!g_stats || !g_uuid || !g_bus || !g_procs)
        return NVML_ERROR_UNKNOWN;
    g_init = 1;
    return NVML_SUCCESS;
}

API int nvmlInit(void) { return nvmlInit_v2(); }

API int nvmlShutdown(void)
{
    g_init = 0;
    return NVML_SUCCESS;
}

API const char *nvmlErrorString(int r)
{
    return r == NVML_SUCCESS ? "Success" : "Error";
}

API int nvmlDeviceGetCount_v2(unsigned int *n)
{
    if (!g_init)
        return NVML_ERROR_UNINITIALIZED;
    if (!n)
        return NVML_ERROR_INVALID_ARGUMENT;
    *n = (unsigned int)count();
    return NVML_SUCCESS;
}

API int nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *dev)
{
    const char *rev = getenv("FAKENVML_REVERSE");
    int n = count();

    if (!g_init)
        return NVML_ERROR_UNINITIALIZED;
    if (!dev || (int)i >= n)
        return NVML_ERROR_INVALID_ARGUMENT;
    g_dev[i].index = rev && *rev == '1' ? n - 1 - (int)i : (int)i;
    *dev = (nvmlDevice_t)&g_dev[i];
    return NVML_SUCCESS;
}

/* Physical view: the fake driver's own bytes (works before cuInit). FAKENVML_DEVICE_WIDE=1
 * with a shared device (FAKECUDA_SHARED_DEVICE): what every process holds on it, as the real
 * nvmlDeviceGetMemoryInfo reports a device (members that read the device's memory
 * see one another's). */
static int phys(nvmlDevice_t dev, unsigned long long *total, unsigned long long *used)
{
    fakecuda_stats_t s;
    const char *wide = getenv("FAKENVML_DEVICE_WIDE");
    unsigned long long all;

    if (!g_init)
        return NVML_ERROR_UNINITIALIZED;
    if (!dev || g_stats(dev->index, &s) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    *total = s.total_bytes;
    *used = s.bytes_held;
    if (wide && *wide == '1' && g_device_held && g_device_held(dev->index, &all) == 0)
        *used = all;
    return NVML_SUCCESS;
}

API int nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *m)
{
    unsigned long long t, u;
    int rc;

    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = phys(dev, &t, &u)) != NVML_SUCCESS)
        return rc;
    m->total = t;
    m->used = u;
    m->free = t - u;
    return NVML_SUCCESS;
}

API int nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *m)
{
    unsigned long long t, u;
    int rc;

    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != NVML_MEMORY_V2)
        return 25; /* NVML_ERROR_ARGUMENT_VERSION_MISMATCH */
    if ((rc = phys(dev, &t, &u)) != NVML_SUCCESS)
        return rc;
    m->total = t;
    m->reserved = 0;
    m->used = u;
    m->free = t - u;
    return NVML_SUCCESS;
}

/* nvmlPciInfo_t as NVML's documentation lays it out (v2 and v3 share it). */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

API int nvmlDeviceGetPciInfo_v3(nvmlDevice_t dev, nvmlPciInfo_t *pci)
{
    int bus;

    if (!g_init)
        return NVML_ERROR_UNINITIALIZED;
    if (!dev || !pci || (bus = g_bus(dev->index)) < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    pci->domain = 0;
    pci->bus = (unsigned int)bus;
    pci->device = 0;
    pci->pciDeviceId = 0x233010de;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02x:00.0", (unsigned char)bus);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02x:00.0", (unsigned char)bus);
    return NVML_SUCCESS;
}

API int nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int len)
{
    unsigned char b[16];

    if (!g_init)
        return NVML_ERROR_UNINITIALIZED;
    if (!dev || !uuid)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (len < 41)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    /* NVML answers before cuInit: the UUID the fake driver reports for this device. */
    if (g_uuid(dev->index, b) != 0)
        return NVML_ERROR_UNKNOWN;
    snprintf(uuid, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    return NVML_SUCCESS;
}

/* nvmlProcessInfo_t (v2 and v3 share it) and nvmlProcessInfo_v1_t, as NVML documents them. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;
#define NVML_NO_INSTANCE 0xFFFFFFFFu

/* The documented contract: *count in = room in infos, out = processes; too little room (or
 * infos NULL with processes to list) is NVML_ERROR_INSUFFICIENT_SIZE with *count the need.
 * Processes are named by host pid, used memory includes contexts and modules. */
static int running(nvmlDevice_t dev, unsigned int *count, void *infos, int v1)
{
    unsigned int pids[64];
    unsigned long long bytes[64];
    int n;

    if (!g_init)
        return NVML_ERROR_UNINITIALIZED;
    if (!dev || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((n = g_procs(dev->index, pids, bytes, 64)) < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (n > 64)
        n = 64;
    if ((unsigned int)n > *count || (n > 0 && !infos)) {
        *count = (unsigned int)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < n; i++) {
        if (v1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + i;
            p->pid = pids[i];
            p->usedGpuMemory = bytes[i];
        } else {
            nvmlProcessInfo_t *p = (nvmlProcessInfo_t *)infos + i;
            p->pid = pids[i];
            p->usedGpuMemory = bytes[i];
            p->gpuInstanceId = p->computeInstanceId = NVML_NO_INSTANCE;
        }
    }
    *count = (unsigned int)n;
    return NVML_SUCCESS;
}

API int nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t dev, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running(dev, count, infos, 0);
}

API int nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t dev, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running(dev, count, infos, 0);
}

API int nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t dev, unsigned int *count, nvmlProcessInfo_v1_t *infos)
{
    return running(dev, count, infos, 1);
}
