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
/// A green context (CUDA 12.4) and a resource descriptor: opaque handles, never read.
pub type CUgreenCtx = *mut c_void;
pub type CUdevResourceDesc = *mut c_void;
pub type cuuint64_t = u64;
/// `CUdriverProcAddressQueryResult`, an enum (int) in C.
pub type CUdriverProcAddressQueryResult = c_int;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;

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

pub type CUstream = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUarray = *mut c_void;
pub type CUmipmappedArray = *mut c_void;
pub type CUmemGenericAllocationHandle = u64;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemLocation {
    pub type_: c_int,
    pub id: c_int,
}
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// The per-thread default stream's handle (`cuda.h`: `((CUstream)0x2)`).
pub const CU_STREAM_PER_THREAD: CUstream = 2 as CUstream;
/// CUDA 13: no preferred location (managed pools only); the value of `..._INVALID`.
pub const CU_MEM_LOCATION_TYPE_NONE: c_int = 0;
/// `CUmemAllocationType`: CUDA 13 managed pools.
pub const CU_MEM_ALLOCATION_TYPE_MANAGED: c_int = 2;

/// The leading fields of `CUmemAllocationProp` (we only read `location`; never sized by us).
#[repr(C)]
pub struct CUmemAllocationProp {
    pub type_: c_int,
    pub requested_handle_types: c_int,
    pub location: CUmemLocation,
}

/// The leading fields of `CUmemPoolProps`.
#[repr(C)]
pub struct CUmemPoolProps {
    pub alloc_type: c_int,
    pub handle_types: c_int,
    pub location: CUmemLocation,
}

/// `CUmemPool_attribute` values we read.
pub const CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: c_int = 4;
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: c_int = 5;
pub const CU_MEMPOOL_ATTR_USED_MEM_CURRENT: c_int = 7;

#[repr(C)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub format: c_int,
    pub num_channels: c_uint,
}

#[repr(C)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: c_int,
    pub num_channels: c_uint,
    pub flags: c_uint,
}

/// The descriptor of the legacy `cuArrayCreate` ABI (32-bit sizes, before CUDA 3.2).
#[repr(C)]
pub struct CUDA_ARRAY_DESCRIPTOR_v1 {
    pub width: c_uint,
    pub height: c_uint,
    pub format: c_int,
    pub num_channels: c_uint,
}

/// The descriptor of the legacy `cuArray3DCreate` ABI.
#[repr(C)]
pub struct CUDA_ARRAY3D_DESCRIPTOR_v1 {
    pub width: c_uint,
    pub height: c_uint,
    pub depth: c_uint,
    pub format: c_int,
    pub num_channels: c_uint,
    pub flags: c_uint,
}

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUipcMemHandle {
    pub reserved: [std::ffi::c_char; 64],
}

/// NVML: `nvmlReturn_t` (int), `nvmlDevice_t` (opaque pointer), `nvmlMemory_t`, `nvmlMemory_v2_t`.
pub type nvmlReturn_t = c_int;
pub type nvmlDevice_t = *mut c_void;
pub const NVML_SUCCESS: nvmlReturn_t = 0;

#[repr(C)]
pub struct nvmlMemory_t {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

#[repr(C)]
pub struct nvmlMemory_v2_t {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

// Streams, graphs and graph memory (stream-ordered memory that a graph launch allocates).
pub type CUgraph = *mut c_void;
pub type CUgraphNode = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub const CU_STREAM_CAPTURE_STATUS_ACTIVE: c_int = 1;
/// `CUgraphNodeType` of a memory allocation node.
pub const CU_GRAPH_NODE_TYPE_MEM_ALLOC: c_int = 10;
pub const CU_GRAPH_NODE_TYPE_GRAPH: c_int = 1;
pub const CU_GRAPH_NODE_TYPE_MEM_FREE: c_int = 11;
/// `CUgraphInstantiate_flags`.
pub const CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH: u64 = 1;
pub const CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD: u64 = 2;
/// `CUgraphMem_attribute`: bytes the device's graph memory currently reserves.
pub const CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: c_int = 2;

/// `CUmemPoolProps` in full (88 bytes: the trailing fields are reserved or unused by us).
#[repr(C)]
pub struct CUmemPoolPropsFull {
    pub alloc_type: c_int,
    pub handle_types: c_int,
    pub location: CUmemLocation,
    pub win32_security_attributes: *mut c_void,
    pub max_size: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (v1), filled by `cuGraphMemAllocNodeGetParams`.
#[repr(C)]
pub struct CUDA_MEM_ALLOC_NODE_PARAMS {
    pub pool_props: CUmemPoolPropsFull,
    pub access_descs: *const c_void,
    pub access_desc_count: usize,
    pub bytesize: usize,
    pub dptr: CUdeviceptr,
}
const _: () = assert!(std::mem::size_of::<CUmemPoolPropsFull>() == 88);
const _: () = assert!(std::mem::size_of::<CUDA_MEM_ALLOC_NODE_PARAMS>() == 120);
/// `nvmlPciInfo_t` (NVML's documented layout, shared by `nvmlDeviceGetPciInfo_v2/_v3`).
#[repr(C)]
pub struct nvmlPciInfo_t {
    pub bus_id_legacy: [std::ffi::c_char; 16],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pci_device_id: c_uint,
    pub pci_sub_system_id: c_uint,
    pub bus_id: [std::ffi::c_char; 32],
}

// Modules and per-context limits (issue 24: memory no allocation returns).
pub type CUmodule = *mut c_void;
pub type CUlimit = c_int;
pub const CU_LIMIT_STACK_SIZE: CUlimit = 0;
pub const CU_LIMIT_PRINTF_FIFO_SIZE: CUlimit = 1;
pub const CU_LIMIT_MALLOC_HEAP_SIZE: CUlimit = 2;
pub const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
pub const CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: c_int = 39;
pub type CUjit_option = c_int;
/// A library (CUDA 12.0: context-independent loading) and its load options.
pub type CUlibrary = *mut c_void;
pub type CUlibraryOption = c_int;
/// `nvmlProcessInfo_t` as `nvmlDeviceGetComputeRunningProcesses_v3` fills it.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct nvmlProcessInfo_t {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
/// `usedGpuMemory` when NVML cannot say (e.g. without the rights to see other processes).
pub const NVML_VALUE_NOT_AVAILABLE: u64 = u64::MAX;
