"""numba-cuda (a second real client; it drives the driver through NVIDIA's cuda-bindings) under
the preload on the fake driver. Run by tests/numba.rs with VRAMCAP_LIMIT=64m. Exits non-zero with
a message on the first wrong answer.

  numba_driver.py cap    -- get_memory_info shows the cap; device arrays up to the cap work and
                            hold their data; one past it raises CudaAPIError(OUT_OF_MEMORY);
                            numba's own deallocate-and-retry succeeds
  numba_driver.py close  -- cuda.close() ends the context; the next one starts from zero
"""
import os
import sys

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError

MIB = 1 << 20
CAP = 64 * MIB
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


def check(what, got, want):
    if got != want:
        sys.exit(f"numba: {what}: got {got}, want {want}")


def code(e):
    return int(getattr(e.code, "value", e.code))


def info():
    free, total = cuda.current_context().get_memory_info()
    check("get_memory_info total", total, CAP)
    return free


def fill_to_cap(chunk):
    arrays = [cuda.device_array(chunk, dtype=np.uint8) for _ in range(CAP // chunk)]
    check("free at the cap", info(), 0)
    return arrays


def past_the_cap():
    try:
        cuda.device_array(MIB, dtype=np.uint8)
    except CudaAPIError as e:
        check("error code one past the cap", code(e), OUT_OF_MEMORY)
        return
    sys.exit("numba: an array past the cap was granted")


def cap():
    check("get_memory_info free", info(), CAP)
    arrays = fill_to_cap(4 * MIB)
    past_the_cap()
    # The memory is real: a round trip through the copy entry points numba uses.
    host = (np.arange(4 * MIB) % 251).astype(np.uint8)
    arrays[-1].copy_to_device(host)
    check("round trip", bool((arrays[-1].copy_to_host() == host).all()), True)
    stream = cuda.stream()
    arrays[-2].copy_to_device(host, stream=stream)
    back = arrays[-2].copy_to_host(stream=stream)
    stream.synchronize()
    check("async round trip", bool((back == host).all()), True)
    arrays[-3].copy_to_device(arrays[-1])
    check("device to device", bool((arrays[-3].copy_to_host() == host).all()), True)
    # numba frees lazily: two dropped arrays (8 MiB, below its flush thresholds) are still held
    # by the driver, so the next allocation is refused by the cap, numba flushes its pending
    # frees and retries, and the retry must succeed.
    del arrays[0:2]
    check("free with frees pending", info(), 0)
    arrays.append(cuda.device_array(8 * MIB, dtype=np.uint8))
    check("free after deallocate-and-retry", info(), 0)
    del arrays
    cuda.current_context().deallocations.clear()
    check("free after all frees", info(), CAP)
    print("numba cap ok")


def close():
    arrays = fill_to_cap(16 * MIB)
    past_the_cap()
    # cuda.close() releases the primary context, which frees its memory (driver docs: the last
    # cuDevicePrimaryCtxRelease resets the context); numba never frees these arrays itself.
    cuda.close()
    old, arrays = arrays, None
    check("free in a new context", info(), CAP)
    arrays = fill_to_cap(16 * MIB)
    print("numba close ok")
    sys.stdout.flush()
    # The old context's arrays died with it: numba's finalizers would free them (an error) at exit.
    os._exit(0)


{"cap": cap, "close": close}[sys.argv[1]]()
