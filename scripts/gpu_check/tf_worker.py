"""TensorFlow worker of scripts/gpu-check.sh, run under the preload by run.py with
TF_FORCE_GPU_ALLOW_GROWTH unset (BFC sized once from cuMemGetInfo) or `true` (allow_growth).

  tf_worker.py STEPS   -> RESULT lines: memory limit from the capped view, training, over-cap alloc"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rows import FAIL, PASS, gib, result_line  # noqa: E402


def report(check, status, figure):
    print(result_line(check, status, figure), flush=True)


def main(steps):
    cap = int(os.environ["GPU_CHECK_CAP_BYTES"])
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.client import device_lib

    gpus = [d for d in device_lib.list_local_devices() if d.device_type == "GPU"]
    if not gpus:
        report("memory limit <= cap", FAIL, f"TensorFlow {tf.__version__} sees no GPU")
        return
    limit = gpus[0].memory_limit
    report("memory limit <= cap", PASS if 0 < limit <= cap else FAIL,
           f"TF {tf.__version__} memory_limit {gib(limit)} ({limit} B), cap {gib(cap)}")

    t = time.perf_counter()
    with tf.device("/GPU:0"):
        model = tf.keras.Sequential([tf.keras.Input((512,)), tf.keras.layers.Dense(2048, activation="relu"),
                                     tf.keras.layers.Dense(512)])
        model.compile(optimizer="adam", loss="mse")
        x = np.random.rand(256 * steps, 512).astype("float32")
        hist = model.fit(x, x, batch_size=256, epochs=1, verbose=0)
    loss = hist.history["loss"][-1]
    report("training steps", PASS if loss == loss else FAIL,
           f"{steps} steps in {time.perf_counter() - t:.1f} s, loss {loss:.4f}")

    n = (cap + (256 << 20)) // 4
    try:
        with tf.device("/GPU:0"):
            big = tf.ones([n], dtype=tf.float32)
            _ = float(tf.reduce_sum(big))
        report("over-cap alloc -> ResourceExhaustedError", FAIL, f"allocating {gib(n * 4)} succeeded")
    except tf.errors.ResourceExhaustedError:
        report("over-cap alloc -> ResourceExhaustedError", PASS, f"{gib(n * 4)} refused with ResourceExhaustedError")
    except Exception as e:  # noqa: BLE001 - any other error is the failure we look for
        report("over-cap alloc -> ResourceExhaustedError", FAIL, f"{type(e).__name__}: {str(e)[:150]}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
