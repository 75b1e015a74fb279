/*
 * inject.c - failure injection for every allocation family of the fake driver
 * (FAKECUDA_FAIL_ALLOC=N:code, fakecuda_fail_nth_alloc): plain, pitch, managed,
 * VMM, pool and array allocations all take a number from one sequence, and the
 * armed number fails with the injected code (docs/reliability.md).
 */
#include "internal.h"

static atomic_llong g_alloc_seq;    /* allocation calls so far */
static atomic_llong g_fail_at;      /* sequence number that fails; 0 = none */
static atomic_int g_fail_code = CUDA_ERROR_OUT_OF_MEMORY;

void fc_mem_config_fail(long long nth, int code)
{
    atomic_store(&g_fail_code, code);
    atomic_store(&g_fail_at, nth);
}

/* Every allocation call of every family (plain, pitch, managed, VMM, pool, array) takes a number;
 * the armed one fails with the injected code. 0: go ahead. */
CUresult fc_mem_inject(void)
{
    long long seq = atomic_fetch_add(&g_alloc_seq, 1) + 1;
    return seq == atomic_load_explicit(&g_fail_at, memory_order_relaxed) ? atomic_load(&g_fail_code) : 0;
}

FC_API void fakecuda_fail_nth_alloc(int n, int code)
{
    atomic_store(&g_fail_code, code);
    atomic_store(&g_fail_at, n > 0 ? atomic_load(&g_alloc_seq) + n : 0);
}
