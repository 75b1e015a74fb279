//! The few CUDA driver and NVML declarations vramcap needs, written from NVIDIA's public API
//! documentation (no NVIDIA header is copied). Only types that cross our hooks appear here.
#![allow(non_camel_case_types, dead_code)]

use std::ffi::{c_int, c_uint, c_void};

/// `CUresult`: an enum in C, passed as a 32-bit int.
pub type CUresult = c_int;
pub type CUdevice = c_int;
/// 64-bit device pointer (`_v2` ABI).
pub type CUdeviceptr = u64;
/// 32-bit device pointer of the legacy v1 ABI (`cuMemAlloc`, `cuMemFree`).
pub type CUdeviceptr_v1 = c_uint;
pub type CUcontext = *mut c_void;
pub type cuuint64_t = u64;
/// `CUdriverProcAddressQueryResult`, an enum (int) in C.
pub type CUdriverProcAddressQueryResult = c_int;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;

/// `cuGetProcAddress` flag: the caller wants per-thread-default-stream (`_ptsz`/`_ptds`) variants.
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 1 << 1;

pub type cuGetProcAddress_v1_t =
    unsafe extern "C" fn(*const std::ffi::c_char, *mut *mut c_void, c_int, cuuint64_t) -> CUresult;
pub type cuGetProcAddress_v2_t = unsafe extern "C" fn(
    *const std::ffi::c_char,
    *mut *mut c_void,
    c_int,
    cuuint64_t,
    *mut CUdriverProcAddressQueryResult,
) -> CUresult;
