/*
 * shared_device.c - device counters shared by processes, as one physical GPU sees all of them.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

/*
 * FAKECUDA_SHARED_DEVICE=FILE: the processes that name one file share its per-device counters
 * (FC_MAX_DEVICES × {held, peak}, unsigned 64-bit, native order), updated atomically with every
 * allocation and free, as one physical GPU would see all of them. Tests read the peak to prove
 * that a group of processes never held more than its budget on the device itself. Unset: off.
 * A file that cannot be opened or mapped stops the process: a test must not pass unwatched.
 */
struct shared_dev {
    atomic_ullong held, peak;
};
static struct shared_dev *g_shared;
static pthread_once_t g_shared_once = PTHREAD_ONCE_INIT;

static void shared_open(void)
{
    const char *path = getenv("FAKECUDA_SHARED_DEVICE");
    size_t len = sizeof(struct shared_dev) * FC_MAX_DEVICES;
    struct stat st;
    void *m;
    int fd;

    if (!path || !*path)
        return;
    fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    /* Growing only: a racing process that already grew it loses nothing. */
    if (fd < 0 || fstat(fd, &st) != 0 || ((size_t)st.st_size < len && ftruncate(fd, (off_t)len) != 0)) {
        fprintf(stderr, "fakecuda: FAKECUDA_SHARED_DEVICE=%s: cannot open: %s\n", path, strerror(errno));
        abort();
    }
    m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        fprintf(stderr, "fakecuda: FAKECUDA_SHARED_DEVICE=%s: cannot map: %s\n", path, strerror(errno));
        abort();
    }
    g_shared = m;
}

void fc_shared_device_account(int devno, long long delta)
{
    struct shared_dev *s;
    unsigned long long now, peak;

    pthread_once(&g_shared_once, shared_open);
    if (!g_shared)
        return;
    s = &g_shared[devno];
    /*
     * The peak is read before the count moves: a test may reset the peak (store the current
     * count) to watch from that moment on, and a thread descheduled between its add and its peak
     * update must not then publish a count from before the reset. The peak only ever goes down
     * by such a reset, so a peak found lower than the one read first means one happened: the
     * update is dropped (at worst an add right at a reset goes unrecorded; never one before it).
     */
    peak = atomic_load(&s->peak);
    now = atomic_fetch_add(&s->held, (unsigned long long)delta) + (unsigned long long)delta;
    while (delta > 0 && now > peak) {
        unsigned long long seen = peak;

        if (atomic_compare_exchange_weak(&s->peak, &peak, now) || peak < seen)
            break;
    }
}
