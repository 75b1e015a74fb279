/*
 * fakecuda.h - test-only API exported by the fake libcuda.so.1.
 *
 * Tests reach these with dlsym() on a dlopen("libcuda.so.1") handle, so that
 * they observe what actually reached the driver (below any interposer).
 */
#ifndef VRAMCAP_FAKECUDA_H
#define VRAMCAP_FAKECUDA_H

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    unsigned long long alloc_calls;  /* allocation calls that reached this device (incl. failed) */
    unsigned long long free_calls;   /* free calls that reached this device (incl. failed) */
    unsigned long long bytes_held;   /* sum of requested sizes of live allocations */
    unsigned long long live_allocs;  /* number of live allocations */
    unsigned long long peak_bytes;   /* high-water mark of bytes_held */
    unsigned long long total_bytes;  /* device capacity */
} fakecuda_stats_t;

/* 0 ok, -1 bad device (or out == NULL). Works before cuInit. */
int fakecuda_stats(int dev, fakecuda_stats_t *out);
/* The 16 bytes cuDeviceGetUuid reports for CUDA ordinal dev, and the PCI bus number
 * cuDeviceGetPCIBusId reports; both answer before cuInit (the fake NVML needs them, as the real
 * NVML knows its GPUs without CUDA). 0 on success, -1 for a device that does not exist. */
int fakecuda_uuid(int dev, unsigned char out[16]);
int fakecuda_pci_bus(int dev);
/* NVML's running-process list of CUDA ordinal dev: fills up to cap (host pid, bytes held) pairs,
 * every process sharing FAKECUDA_SHARED_DEVICE or, without it, this one; returns how many there
 * are (may exceed cap), -1 for a bad device. Works before cuInit. */
int fakecuda_processes(int dev, unsigned int *pids, unsigned long long *bytes, int cap);
int fakecuda_device_held(int dev, unsigned long long *held);
/* Times the exported entry point `exported_name` was entered; 0 if unknown. */
unsigned long long fakecuda_calls(const char *exported_name);
/* The n-th allocation call from now (1 = next) fails with `code`; n <= 0 disarms. */
void fakecuda_fail_nth_alloc(int n, int code);

#ifdef __cplusplus
}
#endif
#endif
