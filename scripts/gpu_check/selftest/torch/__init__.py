"""Stand-in for `torch`, used only by `scripts/gpu-check.sh --self-test` (CI, no GPU).

It offers just the API surface scripts/gpu_check/torch_worker.py uses, and backs every tensor
with a real cuMemAlloc_v2 on the fake driver (cuda-shim's libcuda.so.1) through ctypes, so the
preload's cap, denial, capped cuMemGetInfo and trace are exercised for real and the worker's
control flow and reporting run end to end. Its numbers are not a model's; it proves nothing about
PyTorch itself (that is what the GPU run is for)."""

import ctypes
import sys
import types

__version__ = "0.0+selftest"
version = types.SimpleNamespace(cuda="fake-driver")
uint8, float32 = 1, 4
_state = {"lib": None, "allocated": 0}


def _cu():
    if _state["lib"] is None:
        lib = ctypes.CDLL("libcuda.so.1")  # the driver through dlopen + dlsym, like a runtime
        ctx = ctypes.c_void_p()
        for rc in (lib.cuInit(0), lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), lib.cuCtxSetCurrent(ctx)):
            if rc:
                raise RuntimeError(f"fake driver init failed: CUresult {rc}")
        _state["lib"] = lib
    return _state["lib"]


class Tensor:
    def __init__(self, nbytes, rows=1):
        self.ptr, self.nbytes, self.rows = ctypes.c_uint64(), nbytes, rows
        rc = _cu().cuMemAlloc_v2(ctypes.byref(self.ptr), ctypes.c_size_t(nbytes))
        if rc == 2:
            self.ptr = None
            raise cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")
        if rc:
            self.ptr = None
            raise RuntimeError(f"CUDA error {rc}")
        _state["allocated"] += nbytes

    def __del__(self):
        if getattr(self, "ptr", None) is not None and _state["lib"] is not None:
            _state["lib"].cuMemFree_v2(self.ptr)
            _state["allocated"] -= self.nbytes


def manual_seed(_):
    pass


def empty(n, dtype=uint8, device="cuda"):
    return Tensor(n * dtype)


def randn(rows, cols, device="cuda"):
    return Tensor(rows * cols * 4, rows)


def _cuda_mem_get_info():
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    _cu().cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


cuda = types.ModuleType("torch.cuda")
cuda.OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {})
cuda.mem_get_info = _cuda_mem_get_info
cuda.synchronize = lambda: None
cuda.empty_cache = lambda: None
cuda.memory_allocated = lambda: _state["allocated"]
cuda.memory_reserved = lambda: _state["allocated"]
cuda.get_device_name = lambda i=0: "fake driver (cuda-shim)"


class _Loss:
    def __init__(self, act):
        self.act = act  # keeps the activation alive until backward, like autograd

    def backward(self):
        self.grad = Tensor(self.act.nbytes)
        self.act = None

    def __float__(self):
        return 0.5


class _Linear:
    def __init__(self, i, o):
        self.o, self.weight = o, Tensor(i * o * 4)

    def __call__(self, x):
        return Tensor(x.rows * self.o * 4, x.rows)

    def parameters(self):
        return [self.weight]


class _Sequential:
    def __init__(self, *layers):
        self.layers = layers

    def cuda(self):
        return self

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def parameters(self):
        return [p for layer in self.layers for p in getattr(layer, "parameters", list)()]


class _AdamW:
    def __init__(self, params, lr):
        self.params, self.states = list(params), None

    def zero_grad(self, set_to_none=True):
        pass

    def step(self):
        if self.states is None:  # exp_avg and exp_avg_sq, allocated at the first step
            self.states = [Tensor(p.nbytes) for p in self.params for _ in range(2)]


nn = types.ModuleType("torch.nn")
nn.Sequential, nn.Linear, nn.GELU = _Sequential, _Linear, lambda: (lambda x: x)
nn.functional = types.SimpleNamespace(mse_loss=lambda out, y: _Loss(out))
optim = types.SimpleNamespace(AdamW=_AdamW)
sys.modules.update({"torch.cuda": cuda, "torch.nn": nn})
