/*
 * fakecuda.c - a fake CUDA driver for testing vramcap without a GPU:
 * configuration, cuInit, devices, error strings and the test-only counters.
 * Contexts and streams live in context.c, memory management in fakemem.c,
 * the cuGetProcAddress table in procaddr.c.
 *
 * Devices are simulated on host memory; nothing here talks to hardware.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "size_suffix.h"

__thread struct fc_counter_block *fc_my_counters;
static _Atomic(struct fc_counter_block *) g_counter_blocks;

struct fc_counter_block *fc_counter_block_new(void)
{
    struct fc_counter_block *b = calloc(1, sizeof *b);
    if (!b)
        return NULL;
    b->next = atomic_load(&g_counter_blocks);
    while (!atomic_compare_exchange_weak(&g_counter_blocks, &b->next, b))
        ;
    fc_my_counters = b;
    return b;
}
struct fc_config fc_cfg;
struct fc_devstats fc_stats[FC_MAX_DEVICES];

static atomic_int g_initialized;

/* ------------------------------------------------------------------ config */

static void bad_var(const char *var, const char *val)
{
    fprintf(stderr, "fakecuda: bad %s=%s\n", var, val);
}

/* Strict decimal integer in [lo, hi]; no trailing junk. */
static int parse_int(const char *s, long lo, long hi, long *out)
{
    char *end;
    long v;

    if (!s || !*s)
        return -1;
    errno = 0;
    v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

/* "<digits>[k|m|g|t][i|b|ib]", any case, binary units; must be > 0. */
static int parse_size(const char *s, unsigned long long *out)
{
    unsigned long long v = 0;
    int shift = 0;
    const char *p = s;

    if (*p < '0' || *p > '9')
        return -1;
    for (; *p >= '0' && *p <= '9'; p++) {
        if (v > (ULLONG_MAX - 9) / 10)
            return -1;
        v = v * 10 + (unsigned long long)(*p - '0');
    }
    shift = size_suffix_shift(&p);
    if (*p || v == 0 || v > (ULLONG_MAX >> shift))
        return -1;
    *out = v << shift;
    return 0;
}

/* Comma list of sizes; missing trailing entries repeat the last one. */
static int parse_mem_list(const char *s, unsigned long long *mem)
{
    char buf[512];
    char *save = NULL, *tok;
    int n = 0;

    if (strlen(s) >= sizeof buf)
        return -1;
    strcpy(buf, s);
    for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (n >= FC_MAX_DEVICES || parse_size(tok, &mem[n]))
            return -1;
        n++;
    }
    if (n == 0)
        return -1;
    for (int i = n; i < FC_MAX_DEVICES; i++)
        mem[i] = mem[n - 1];
    return 0;
}

static void config_load_once(void)
{
    const char *v;
    long n;

    fc_cfg.device_count = 2;
    fc_cfg.driver_version = 13050;
    fc_cfg.init_fail = 0;
    for (int i = 0; i < FC_MAX_DEVICES; i++)
        fc_cfg.mem[i] = 16ULL << 30;

    if ((v = getenv("FAKECUDA_DEVICE_COUNT"))) {
        if (parse_int(v, 0, FC_MAX_DEVICES, &n) == 0)
            fc_cfg.device_count = (int)n;
        else
            bad_var("FAKECUDA_DEVICE_COUNT", v);
    }
    if ((v = getenv("FAKECUDA_MEM"))) {
        unsigned long long mem[FC_MAX_DEVICES];
        if (parse_mem_list(v, mem) == 0)
            memcpy(fc_cfg.mem, mem, sizeof mem);
        else
            bad_var("FAKECUDA_MEM", v);
    }
    /* What one context costs on its device (0 or a size; unset: 0, as the fake always was). */
    if ((v = getenv("FAKECUDA_CTX_BYTES")) && strcmp(v, "0") != 0 && parse_size(v, &fc_cfg.ctx_bytes))
        bad_var("FAKECUDA_CTX_BYTES", v);
    if ((v = getenv("FAKECUDA_DRIVER_VERSION"))) {
        if (parse_int(v, 1, INT_MAX, &n) == 0)
            fc_cfg.driver_version = (int)n;
        else
            bad_var("FAKECUDA_DRIVER_VERSION", v);
    }
    if ((v = getenv("FAKECUDA_INIT_FAIL"))) {
        if (parse_int(v, 0, INT_MAX, &n) == 0)
            fc_cfg.init_fail = (int)n;
        else
            bad_var("FAKECUDA_INIT_FAIL", v);
    }
    /* A driver whose free returns well after the memory is reusable (cuMemFree synchronizes):
     * another thread can be handed the address before the free returns. */
    if ((v = getenv("FAKECUDA_FREE_DELAY_US"))) {
        if (parse_int(v, 0, 10000000, &n) == 0)
            fc_cfg.free_delay_us = n;
        else
            bad_var("FAKECUDA_FREE_DELAY_US", v);
    }
    /* A driver whose relaunch of an auto-free graph takes this long to reach the memory the last
     * launch left (it frees and reuses it then): whatever another thread does meanwhile happens
     * between the call and that reuse. */
    if ((v = getenv("FAKECUDA_RELAUNCH_DELAY_US"))) {
        if (parse_int(v, 0, 10000000, &n) == 0)
            fc_cfg.relaunch_delay_us = n;
        else
            bad_var("FAKECUDA_RELAUNCH_DELAY_US", v);
    }
    /* A driver that takes this long to make a context (a real one takes tens to hundreds of
     * milliseconds), holding the context's memory meanwhile: members starting together overlap. */
    if ((v = getenv("FAKECUDA_CTX_DELAY_US"))) {
        if (parse_int(v, 0, 10000000, &n) == 0)
            fc_cfg.ctx_delay_us = n;
        else
            bad_var("FAKECUDA_CTX_DELAY_US", v);
    }
    /* A driver that sets a context up for this long before its memory is taken (a real one
     * initialises the device's state first and takes the memory as it goes). */
    if ((v = getenv("FAKECUDA_CTX_SETUP_US"))) {
        if (parse_int(v, 0, 10000000, &n) == 0)
            fc_cfg.ctx_setup_us = n;
        else
            bad_var("FAKECUDA_CTX_SETUP_US", v);
    }
    if ((v = getenv("FAKECUDA_FAIL_ALLOC"))) {
        char buf[64];
        char *colon;
        long nth = 0, code = CUDA_ERROR_OUT_OF_MEMORY;
        int ok = strlen(v) < sizeof buf;

        if (ok) {
            strcpy(buf, v);
            colon = strchr(buf, ':');
            if (colon)
                *colon = '\0';
            ok = parse_int(buf, 1, LONG_MAX, &nth) == 0 &&
                 (!colon || parse_int(colon + 1, 1, INT_MAX, &code) == 0);
        }
        if (ok)
            fc_mem_config_fail(nth, (int)code);
        else
            bad_var("FAKECUDA_FAIL_ALLOC", v);
    }
}

/* The environment is read once per process, by whichever of cuInit,
 * cuDriverGetVersion or cuGetProcAddress comes first (the latter two work
 * before cuInit and need the driver version). */
void fc_config_load(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, config_load_once);
}

int fc_initialized(void)
{
    return atomic_load_explicit(&g_initialized, memory_order_acquire);
}

/* ---------------------------------------------------------- init / devices */

FC_API CUresult cuInit(unsigned int flags)
{
    FC_COUNT(cuInit);
    fc_config_load();
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (fc_cfg.init_fail)
        return fc_cfg.init_fail;
    if (fc_cfg.device_count == 0)
        return CUDA_ERROR_NO_DEVICE;
    atomic_store_explicit(&g_initialized, 1, memory_order_release);
    return CUDA_SUCCESS;
}

FC_API CUresult cuDriverGetVersion(int *version)
{
    FC_COUNT(cuDriverGetVersion);
    fc_config_load();
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = fc_cfg.driver_version;
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
    FC_COUNT(cuDeviceGet);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetCount(int *count)
{
    FC_COUNT(cuDeviceGetCount);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = fc_cfg.device_count;
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    FC_COUNT(cuDeviceGetName);
    DEV_CHECK(name, dev);
    if (len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "FakeCUDA Device %d", dev);
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    FC_COUNT(cuDeviceTotalMem);
    DEV_CHECK(bytes, dev);
    /* The v1 ABI has only 32 bits: saturate, as a large device would. */
    *bytes = fc_cfg.mem[dev] > UINT_MAX ? UINT_MAX : (unsigned int)fc_cfg.mem[dev];
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    FC_COUNT(cuDeviceTotalMem_v2);
    DEV_CHECK(bytes, dev);
    *bytes = (size_t)fc_cfg.mem[dev];
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    int v;

    FC_COUNT(cuDeviceGetAttribute);
    DEV_CHECK(pi, dev);
    /* A plausible recent data-centre GPU; anything not listed reads 0. */
    switch (attrib) {
    case 1:  v = 1024; break;          /* MAX_THREADS_PER_BLOCK */
    case 2:  v = 1024; break;          /* MAX_BLOCK_DIM_X */
    case 3:  v = 1024; break;          /* MAX_BLOCK_DIM_Y */
    case 4:  v = 64; break;            /* MAX_BLOCK_DIM_Z */
    case 5:  v = INT_MAX; break;       /* MAX_GRID_DIM_X */
    case 6:  v = 65535; break;         /* MAX_GRID_DIM_Y */
    case 7:  v = 65535; break;         /* MAX_GRID_DIM_Z */
    case 8:  v = 49152; break;         /* MAX_SHARED_MEMORY_PER_BLOCK */
    case 9:  v = 65536; break;         /* TOTAL_CONSTANT_MEMORY */
    case 10: v = 32; break;            /* WARP_SIZE */
    case 12: v = 65536; break;         /* MAX_REGISTERS_PER_BLOCK */
    case 13: v = 1980000; break;       /* CLOCK_RATE (kHz) */
    case 16: v = FC_SM_COUNT; break;   /* MULTIPROCESSOR_COUNT */
    case 19: v = 1; break;             /* CAN_MAP_HOST_MEMORY */
    case 31: v = 1; break;             /* CONCURRENT_KERNELS */
    case 33: v = 0x10 + dev; break;    /* PCI_BUS_ID (matches cuDeviceGetPCIBusId) */
    case 34: v = 0; break;             /* PCI_DEVICE_ID */
    case 36: v = 2619000; break;       /* MEMORY_CLOCK_RATE (kHz) */
    case 37: v = 5120; break;          /* GLOBAL_MEMORY_BUS_WIDTH */
    case 38: v = 50 << 20; break;      /* L2_CACHE_SIZE */
    case 39: v = FC_THREADS_PER_SM; break; /* MAX_THREADS_PER_MULTIPROCESSOR */
    case 40: v = 2; break;             /* ASYNC_ENGINE_COUNT */
    case 41: v = 1; break;             /* UNIFIED_ADDRESSING */
    case 75: v = 9; break;             /* COMPUTE_CAPABILITY_MAJOR */
    case 76: v = 0; break;             /* COMPUTE_CAPABILITY_MINOR */
    case 83: v = 1; break;             /* MANAGED_MEMORY */
    default: v = 0; break;
    }
    *pi = v;
    return CUDA_SUCCESS;
}

/* Device i: 89 32 f9 (37+i) then a fixed tail, i.e. "GPU-8932f937-..." for 0. */
static void fill_uuid(CUuuid *u, CUdevice dev)
{
    static const unsigned char tail[12] = {
        0x5a, 0x1e, 0x4c, 0x0d, 0x9b, 0x6a, 0x7f, 0x21, 0xc3, 0x44, 0xe8, 0x10
    };
    unsigned char b[16] = { 0x89, 0x32, 0xf9, (unsigned char)(0x37 + dev) };

    memcpy(b + 4, tail, sizeof tail);
    memcpy(u->bytes, b, 16);
}

FC_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    FC_COUNT(cuDeviceGetUuid);
    DEV_CHECK(uuid, dev);
    fill_uuid(uuid, dev);
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    FC_COUNT(cuDeviceGetUuid_v2);
    DEV_CHECK(uuid, dev);
    fill_uuid(uuid, dev);
    return CUDA_SUCCESS;
}

FC_API CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    FC_COUNT(cuDeviceGetPCIBusId);
    DEV_CHECK(pciBusId, dev);
    if (len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", 0x10 + dev);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ error strings */

static const struct { CUresult code; const char *name, *text; } g_errors[] = {
    { 0,   "CUDA_SUCCESS", "no error" },
    { 1,   "CUDA_ERROR_INVALID_VALUE", "invalid argument" },
    { 2,   "CUDA_ERROR_OUT_OF_MEMORY", "out of memory" },
    { 3,   "CUDA_ERROR_NOT_INITIALIZED", "initialization error" },
    { 4,   "CUDA_ERROR_DEINITIALIZED", "driver shutting down" },
    { 100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected" },
    { 101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal" },
    { 201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context" },
    { 400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle" },
    { 500, "CUDA_ERROR_NOT_FOUND", "named symbol not found" },
    { 600, "CUDA_ERROR_NOT_READY", "device not ready" },
    { 800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted" },
    { 801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported" },
    { 999, "CUDA_ERROR_UNKNOWN", "unknown error" },
};

static CUresult error_lookup(CUresult error, const char **pStr, int want_name)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++)
        if (g_errors[i].code == error) {
            *pStr = want_name ? g_errors[i].name : g_errors[i].text;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

FC_API CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    FC_COUNT(cuGetErrorString);
    return error_lookup(error, pStr, 0);
}

FC_API CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    FC_COUNT(cuGetErrorName);
    return error_lookup(error, pStr, 1);
}

/* ----------------------------------------------------------- test-only API */

FC_API int fakecuda_uuid(int dev, unsigned char out[16])
{
    CUuuid u;

    fc_config_load();
    if (!out || !valid_dev(dev))
        return -1;
    fill_uuid(&u, dev);
    memcpy(out, u.bytes, 16);
    return 0;
}

FC_API int fakecuda_pci_bus(int dev)
{
    fc_config_load();
    return valid_dev(dev) ? 0x10 + dev : -1;
}

FC_API int fakecuda_stats(int dev, fakecuda_stats_t *out)
{
    struct fc_devstats *s;

    fc_config_load();
    fc_vmm_reap();
    if (!out || !valid_dev(dev))
        return -1;
    s = &fc_stats[dev];
    out->alloc_calls = atomic_load(&s->alloc_calls);
    out->free_calls = atomic_load(&s->free_calls);
    out->bytes_held = atomic_load(&s->bytes_held);
    out->live_allocs = atomic_load(&s->live_allocs);
    out->peak_bytes = atomic_load(&s->peak_bytes);
    out->total_bytes = fc_cfg.mem[dev];
    return 0;
}

static const char *const g_ep_names[FC_EP_COUNT] = {
#define EP(base, sym, since, ptds) #sym,
#include "entrypoints.def"
#undef EP
};

FC_API unsigned long long fakecuda_calls(const char *exported_name)
{
    if (!exported_name)
        return 0;
    for (int i = 0; i < FC_EP_COUNT; i++)
        if (strcmp(g_ep_names[i], exported_name) == 0)
        {
            unsigned long long sum = 0;
            for (struct fc_counter_block *b = atomic_load(&g_counter_blocks); b; b = b->next)
                sum += atomic_load_explicit(&b->n[i], memory_order_relaxed);
            return sum;
        }
    return 0;
}

/*
 * FAKECUDA_CTOR_LOOKUP=1: while being loaded, look driver names up through dlsym, as some
 * driver builds and profilers do from their constructors. An interposer that initialises itself
 * inside its own dlopen of the driver must not re-enter itself or deadlock here.
 */
#include <dlfcn.h>
__attribute__((constructor)) static void fakecuda_ctor_lookup(void)
{
    const char *v = getenv("FAKECUDA_CTOR_LOOKUP");
    if (!v || strcmp(v, "1"))
        return;
    void *a = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    void *b = dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2");
    fprintf(stderr, "fakecuda: constructor lookups %s\n", a && b ? "ok" : "missing");
}
