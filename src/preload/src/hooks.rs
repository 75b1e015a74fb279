//! The one declarative hook table. Each line names an exported driver entry point, its C
//! signature, where `cuGetProcAddress` places it (base name, the CUDA version that introduced
//! this ABI, per-thread-default-stream variant or not) and the Rust function that implements it.
//! From that one line come: the exported wrapper (`#[no_mangle] extern "C"`), the typed accessor
//! for the real function (`real::name()`), the `dlsym` answer and the `cuGetProcAddress` answer.
//! No symbol list is kept anywhere else.

use crate::dl::Slot;
use crate::ffi::*;
use crate::intercept::{arrays, context, graph, green, host, init, libraries, managed, mem, modules, nvml, pool, procaddr, vmm};
use std::ffi::{c_char, c_int, c_uint, c_void};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Lib {
    Cuda = 0,
    Nvml = 1,
}

#[derive(Debug)]
pub struct HookInfo {
    /// The exported symbol, e.g. `cuMemAlloc_v2`.
    pub name: &'static str,
    pub lib: Lib,
    /// The `cuGetProcAddress` base name, e.g. `cuMemAlloc`.
    pub base: &'static str,
    /// The CUDA version (1000·major + 10·minor) that introduced this ABI.
    pub since: i32,
    /// A `_ptsz`/`_ptds` variant, handed out for `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
    pub per_thread: bool,
    pub hook: Hook,
}

macro_rules! unit {
    ($x:tt) => {
        ()
    };
}

macro_rules! hook_table {
    ($(
        $(#[doc = $doc:literal])*
        $lib:ident $base:literal $since:literal $per_thread:literal
        fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) -> $ret:ty => $imp:path;
    )*) => {
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(u16)]
        pub enum Hook { $($name),* }

        const COUNT: usize = <[()]>::len(&[$(unit!($name)),*]);

        pub static HOOKS: [HookInfo; COUNT] = [$(HookInfo {
            name: stringify!($name),
            lib: Lib::$lib,
            base: $base,
            since: $since,
            per_thread: $per_thread,
            hook: Hook::$name,
        }),*];

        static SLOTS: [Slot; COUNT] = [$(Slot::new(concat!(stringify!($name), "\0"), Lib::$lib)),*];

        /// The exported wrappers: what `LD_PRELOAD` puts in front of the driver.
        pub mod exports {
            #[allow(unused_imports)]
            use super::*;
            $(
                $(#[doc = $doc])*
                #[allow(non_snake_case)]
                #[cfg_attr(not(test), unsafe(no_mangle))]
                pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
                    // A neighbour's pressure is answered at our next driver call (issue 17).
                    if matches!(Lib::$lib, Lib::Cuda) {
                        crate::intercept::pressure::answer_neighbours();
                    }
                    unsafe { $imp($($arg),*) }
                }
            )*
        }

        /// Typed access to the real driver functions (`None` when the driver lacks one).
        pub mod real {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[allow(non_snake_case)]
                #[inline]
                pub fn $name() -> Option<unsafe extern "C" fn($($ty),*) -> $ret> {
                    let p = SLOTS[Hook::$name as usize].get();
                    if p.is_null() {
                        None
                    } else {
                        Some(unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> $ret>(p) })
                    }
                }
            )*
        }

        /// The address we hand out in place of the driver's.
        pub fn wrapper(h: Hook) -> *mut c_void {
            match h {
                $(Hook::$name => exports::$name as *const () as *mut c_void),*
            }
        }
    };
}

/// Driver functions we call but do not wrap.
macro_rules! import_table {
    ($( $lib:ident fn $name:ident ( $($ty:ty),* ) -> $ret:ty; )*) => {
        pub mod import {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[allow(non_snake_case)]
                #[inline]
                pub fn $name() -> Option<unsafe extern "C" fn($($ty),*) -> $ret> {
                    static SLOT: Slot = Slot::new(concat!(stringify!($name), "\0"), Lib::$lib);
                    let p = SLOT.get();
                    if p.is_null() {
                        None
                    } else {
                        Some(unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> $ret>(p) })
                    }
                }
            )*
        }
    };
}

hook_table! {
    Cuda "cuInit" 2000 false fn cuInit(flags: c_uint) -> CUresult => init::cu_init;
    Cuda "cuGetProcAddress" 11030 false
        fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: cuuint64_t)
            -> CUresult => procaddr::get_proc_address_v1;
    Cuda "cuGetProcAddress" 12000 false
        fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: cuuint64_t,
            status: *mut CUdriverProcAddressQueryResult) -> CUresult => procaddr::get_proc_address_v2;
    /// Legacy 32-bit ABI (CUDA < 3.2 callers).
    Cuda "cuMemAlloc" 2000 false fn cuMemAlloc(dptr: *mut CUdeviceptr_v1, bytesize: c_uint) -> CUresult => mem::alloc_v1;
    Cuda "cuMemAlloc" 3020 false fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult => mem::alloc_v2;
    Cuda "cuMemFree" 2000 false fn cuMemFree(dptr: CUdeviceptr_v1) -> CUresult => mem::free_v1;
    Cuda "cuMemFree" 3020 false fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult => mem::free_v2;
    Cuda "cuMemGetInfo" 2000 false fn cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) -> CUresult => mem::get_info_v1;
    Cuda "cuMemGetInfo" 3020 false fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult => mem::get_info_v2;
    Cuda "cuDeviceTotalMem" 2000 false fn cuDeviceTotalMem(bytes: *mut c_uint, dev: CUdevice) -> CUresult => mem::total_mem_v1;
    Cuda "cuDeviceTotalMem" 3020 false fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult => mem::total_mem_v2;
    Cuda "cuMemAllocPitch" 3020 false
        fn cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: c_uint)
            -> CUresult => mem::alloc_pitch_v2;
    Cuda "cuMemAllocManaged" 6000 false
        fn cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) -> CUresult => managed::alloc;
    /// Prefetches make managed memory resident at their destination: charged there.
    Cuda "cuMemPrefetchAsync" 8000 false
        fn cuMemPrefetchAsync(ptr: CUdeviceptr, len: usize, dst: CUdevice, stream: CUstream) -> CUresult
            => managed::prefetch_v1;
    Cuda "cuMemPrefetchAsync" 8000 true
        fn cuMemPrefetchAsync_ptsz(ptr: CUdeviceptr, len: usize, dst: CUdevice, stream: CUstream) -> CUresult
            => managed::prefetch_v1_ptsz;
    Cuda "cuMemPrefetchAsync" 12020 false
        fn cuMemPrefetchAsync_v2(ptr: CUdeviceptr, len: usize, loc: CUmemLocation, flags: c_uint, stream: CUstream)
            -> CUresult => managed::prefetch_v2;
    Cuda "cuMemPrefetchAsync" 12020 true
        fn cuMemPrefetchAsync_v2_ptsz(ptr: CUdeviceptr, len: usize, loc: CUmemLocation, flags: c_uint, stream: CUstream)
            -> CUresult => managed::prefetch_v2_ptsz;
    Cuda "cuMemPrefetchBatchAsync" 13000 false
        fn cuMemPrefetchBatchAsync(ptrs: *mut CUdeviceptr, sizes: *mut usize, count: usize, locs: *mut CUmemLocation,
            idxs: *mut usize, nlocs: usize, flags: u64, stream: CUstream) -> CUresult => managed::prefetch_batch;
    Cuda "cuMemPrefetchBatchAsync" 13000 true
        fn cuMemPrefetchBatchAsync_ptsz(ptrs: *mut CUdeviceptr, sizes: *mut usize, count: usize,
            locs: *mut CUmemLocation, idxs: *mut usize, nlocs: usize, flags: u64, stream: CUstream) -> CUresult
            => managed::prefetch_batch_ptsz;
    Cuda "cuMemDiscardAndPrefetchBatchAsync" 13000 false
        fn cuMemDiscardAndPrefetchBatchAsync(ptrs: *mut CUdeviceptr, sizes: *mut usize, count: usize,
            locs: *mut CUmemLocation, idxs: *mut usize, nlocs: usize, flags: u64, stream: CUstream) -> CUresult
            => managed::discard_prefetch_batch;
    Cuda "cuMemDiscardAndPrefetchBatchAsync" 13000 true
        fn cuMemDiscardAndPrefetchBatchAsync_ptsz(ptrs: *mut CUdeviceptr, sizes: *mut usize, count: usize,
            locs: *mut CUmemLocation, idxs: *mut usize, nlocs: usize, flags: u64, stream: CUstream) -> CUresult
            => managed::discard_prefetch_batch_ptsz;
    /// Legacy 32-bit ABI (CUDA < 3.2 callers).
    Cuda "cuMemAllocPitch" 2000 false
        fn cuMemAllocPitch(dptr: *mut CUdeviceptr_v1, pitch: *mut c_uint, width: c_uint, height: c_uint, elem: c_uint)
            -> CUresult => mem::alloc_pitch_v1;

    // Virtual memory management: physical handles are charged, mappings only traced.
    Cuda "cuMemCreate" 10020 false
        fn cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp,
            flags: u64) -> CUresult => vmm::create;
    Cuda "cuMemRelease" 10020 false fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult => vmm::release;
    Cuda "cuMemAddressReserve" 10020 false
        fn cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, align: usize, addr: CUdeviceptr, flags: u64)
            -> CUresult => vmm::address_reserve;
    Cuda "cuMemAddressFree" 10020 false fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult => vmm::address_free;
    Cuda "cuMemMap" 10020 false
        fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64)
            -> CUresult => vmm::map;
    Cuda "cuMemUnmap" 10020 false fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult => vmm::unmap;
    /// One more reference to the allocation mapped at `addr` (NCCL frees through it).
    Cuda "cuMemRetainAllocationHandle" 11000 false
        fn cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) -> CUresult
            => vmm::retain_handle;
    /// Sparse-array mappings keep VMM memory alive where vramcap cannot follow them: refused.
    Cuda "cuMemMapArrayAsync" 11010 false
        fn cuMemMapArrayAsync(info: *mut c_void, count: c_uint, stream: CUstream) -> CUresult => vmm::map_array_async;
    Cuda "cuMemMapArrayAsync" 11010 true
        fn cuMemMapArrayAsync_ptsz(info: *mut c_void, count: c_uint, stream: CUstream) -> CUresult
            => vmm::map_array_async_ptsz;
    Cuda "cuMemImportFromShareableHandle" 10020 false
        fn cuMemImportFromShareableHandle(handle: *mut CUmemGenericAllocationHandle, os: *mut c_void, kind: c_int)
            -> CUresult => vmm::import_shareable;
    /// An exported allocation can live on in whoever imports it: its charge is kept for good.
    Cuda "cuMemExportToShareableHandle" 10020 false
        fn cuMemExportToShareableHandle(shareable: *mut c_void, handle: CUmemGenericAllocationHandle, kind: c_int,
            flags: u64) -> CUresult => vmm::export_shareable;

    // Stream-ordered allocation: pools are charged what they really reserve.
    Cuda "cuDeviceGetDefaultMemPool" 11020 false
        fn cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult => pool::default_pool;
    Cuda "cuMemPoolCreate" 11020 false
        fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) -> CUresult => pool::create;
    Cuda "cuMemPoolDestroy" 11020 false fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult => pool::destroy;
    Cuda "cuMemPoolSetAttribute" 11020 false
        fn cuMemPoolSetAttribute(pool: CUmemoryPool, attr: c_int, value: *mut c_void) -> CUresult => pool::set_attribute;
    Cuda "cuMemPoolTrimTo" 11020 false fn cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) -> CUresult => pool::trim_to;
    Cuda "cuMemAllocAsync" 11020 false
        fn cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) -> CUresult => pool::alloc_async;
    Cuda "cuMemAllocAsync" 11020 true
        fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) -> CUresult => pool::alloc_async_ptsz;
    Cuda "cuMemAllocFromPoolAsync" 11020 false
        fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream)
            -> CUresult => pool::alloc_from_pool;
    Cuda "cuMemAllocFromPoolAsync" 11020 true
        fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream)
            -> CUresult => pool::alloc_from_pool_ptsz;
    Cuda "cuMemFreeAsync" 11020 false fn cuMemFreeAsync(ptr: CUdeviceptr, stream: CUstream) -> CUresult => pool::free_async;
    Cuda "cuMemFreeAsync" 11020 true
        fn cuMemFreeAsync_ptsz(ptr: CUdeviceptr, stream: CUstream) -> CUresult => pool::free_async_ptsz;
    /// Synchronizes are where a pool gives memory back: re-read pools after them.
    Cuda "cuStreamSynchronize" 2000 false fn cuStreamSynchronize(stream: CUstream) -> CUresult => pool::stream_sync;
    Cuda "cuStreamSynchronize" 7000 true
        fn cuStreamSynchronize_ptsz(stream: CUstream) -> CUresult => pool::stream_sync_ptsz;
    Cuda "cuCtxSynchronize" 2000 false fn cuCtxSynchronize() -> CUresult => pool::ctx_sync;
    Cuda "cuCtxSynchronize" 13000 false fn cuCtxSynchronize_v2(ctx: CUcontext) -> CUresult => pool::ctx_sync_v2;
    /// Every way to learn a device's pool registers that pool on the right device.
    Cuda "cuDeviceGetMemPool" 11020 false
        fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult => pool::current_pool;
    Cuda "cuMemGetDefaultMemPool" 13000 false
        fn cuMemGetDefaultMemPool(pool: *mut CUmemoryPool, loc: *mut CUmemLocation, kind: c_int) -> CUresult
            => pool::location_default_pool;
    Cuda "cuMemGetMemPool" 13000 false
        fn cuMemGetMemPool(pool: *mut CUmemoryPool, loc: *mut CUmemLocation, kind: c_int) -> CUresult
            => pool::location_current_pool;

    // Graph memory: allocated at launch; each device's graph-memory reservation is charged.
    Cuda "cuGraphInstantiate" 10000 false
        fn cuGraphInstantiate(exec: *mut CUgraphExec, graph: CUgraph, err: *mut CUgraphNode, log: *mut c_char,
            size: usize) -> CUresult => graph::instantiate_v1;
    Cuda "cuGraphInstantiate" 11000 false
        fn cuGraphInstantiate_v2(exec: *mut CUgraphExec, graph: CUgraph, err: *mut CUgraphNode, log: *mut c_char,
            size: usize) -> CUresult => graph::instantiate_v2;
    Cuda "cuGraphInstantiateWithFlags" 11040 false
        fn cuGraphInstantiateWithFlags(exec: *mut CUgraphExec, graph: CUgraph, flags: u64) -> CUresult
            => graph::instantiate_with_flags;
    Cuda "cuGraphInstantiateWithParams" 12000 false
        fn cuGraphInstantiateWithParams(exec: *mut CUgraphExec, graph: CUgraph, params: *mut c_void) -> CUresult
            => graph::instantiate_with_params;
    Cuda "cuGraphInstantiateWithParams" 12000 true
        fn cuGraphInstantiateWithParams_ptsz(exec: *mut CUgraphExec, graph: CUgraph, params: *mut c_void)
            -> CUresult => graph::instantiate_with_params_ptsz;
    Cuda "cuGraphLaunch" 10000 false fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult => graph::launch;
    Cuda "cuGraphLaunch" 10000 true
        fn cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult => graph::launch_ptsz;
    Cuda "cuGraphUpload" 11010 false fn cuGraphUpload(exec: CUgraphExec, stream: CUstream) -> CUresult => graph::upload;
    Cuda "cuGraphUpload" 11010 true
        fn cuGraphUpload_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult => graph::upload_ptsz;
    Cuda "cuGraphExecDestroy" 10000 false fn cuGraphExecDestroy(exec: CUgraphExec) -> CUresult => graph::exec_destroy;
    // Whole-graph update: the executable graph's memory nodes follow the graph it is updated with.
    Cuda "cuGraphExecUpdate" 10020 false
        fn cuGraphExecUpdate(exec: CUgraphExec, graph: CUgraph, err: *mut CUgraphNode, result: *mut c_int) -> CUresult
        => graph::exec_update_v1;
    Cuda "cuGraphExecUpdate" 12000 false
        fn cuGraphExecUpdate_v2(exec: CUgraphExec, graph: CUgraph, info: *mut c_void) -> CUresult => graph::exec_update_v2;
    Cuda "cuDeviceGraphMemTrim" 11040 false fn cuDeviceGraphMemTrim(dev: CUdevice) -> CUresult => graph::mem_trim;

    // Arrays: bytes from the descriptor.
    Cuda "cuArrayCreate" 3020 false
        fn cuArrayCreate_v2(arr: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) -> CUresult => arrays::create_2d;
    Cuda "cuArray3DCreate" 3020 false
        fn cuArray3DCreate_v2(arr: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult => arrays::create_3d;
    /// Legacy 32-bit descriptors (CUDA < 3.2 callers).
    Cuda "cuArrayCreate" 2000 false
        fn cuArrayCreate(arr: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR_v1) -> CUresult => arrays::create_2d_v1;
    Cuda "cuArray3DCreate" 2000 false
        fn cuArray3DCreate(arr: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR_v1) -> CUresult => arrays::create_3d_v1;
    Cuda "cuArrayDestroy" 2000 false fn cuArrayDestroy(arr: CUarray) -> CUresult => arrays::destroy;
    Cuda "cuMipmappedArrayCreate" 5000 false
        fn cuMipmappedArrayCreate(arr: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint)
            -> CUresult => arrays::create_mipmapped;
    Cuda "cuMipmappedArrayDestroy" 5000 false
        fn cuMipmappedArrayDestroy(arr: CUmipmappedArray) -> CUresult => arrays::destroy_mipmapped;

    // Contexts: the end of one (destroy, last detach, last primary release, primary reset)
    // releases the charges of the memory the driver frees with it.
    Cuda "cuCtxDestroy" 2000 false fn cuCtxDestroy(ctx: CUcontext) -> CUresult => context::destroy_v1;
    Cuda "cuCtxDestroy" 4000 false fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult => context::destroy_v2;
    Cuda "cuDevicePrimaryCtxReset" 7000 false fn cuDevicePrimaryCtxReset(dev: CUdevice) -> CUresult => context::reset_v1;
    Cuda "cuDevicePrimaryCtxReset" 11000 false
        fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult => context::reset_v2;
    Cuda "cuDevicePrimaryCtxRetain" 7000 false
        fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult => context::primary_retain;
    Cuda "cuDevicePrimaryCtxRelease" 7000 false
        fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult => context::primary_release_v1;
    Cuda "cuDevicePrimaryCtxRelease" 11000 false
        fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult => context::primary_release_v2;
    Cuda "cuCtxCreate" 2000 false
        fn cuCtxCreate(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult => context::create_v1;
    Cuda "cuCtxCreate" 3020 false
        fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult => context::create_v2;
    /// Execution-affinity parameters (MPS), passed through unread.
    Cuda "cuCtxCreate" 11040 false
        fn cuCtxCreate_v3(pctx: *mut CUcontext, params: *mut c_void, n: c_int, flags: c_uint, dev: CUdevice)
            -> CUresult => context::create_v3;
    /// CUDA 12.5+ (`cuCtxCreate` in CUDA 13 headers): creation parameters, passed through unread.
    Cuda "cuCtxCreate" 12050 false
        fn cuCtxCreate_v4(pctx: *mut CUcontext, params: *mut c_void, flags: c_uint, dev: CUdevice) -> CUresult
            => context::create_v4;
    Cuda "cuCtxAttach" 2000 false fn cuCtxAttach(pctx: *mut CUcontext, flags: c_uint) -> CUresult => context::attach;
    Cuda "cuCtxDetach" 2000 false fn cuCtxDetach(ctx: CUcontext) -> CUresult => context::detach;
    /// Green contexts share the primary context's memory: what is allocated in one goes when the
    /// primary context ends (a green context's destroy releases it).
    Cuda "cuGreenCtxCreate" 12040 false
        fn cuGreenCtxCreate(g: *mut CUgreenCtx, desc: CUdevResourceDesc, dev: CUdevice, flags: c_uint) -> CUresult
            => green::create;
    Cuda "cuCtxFromGreenCtx" 12040 false
        fn cuCtxFromGreenCtx(pctx: *mut CUcontext, g: CUgreenCtx) -> CUresult => green::to_context;
    Cuda "cuGreenCtxDestroy" 12040 false fn cuGreenCtxDestroy(g: CUgreenCtx) -> CUresult => green::destroy;

    // Traced, not counted: host memory and memory another process owns.
    Cuda "cuMemHostAlloc" 2020 false
        fn cuMemHostAlloc(pp: *mut *mut c_void, size: usize, flags: c_uint) -> CUresult => host::host_alloc;
    Cuda "cuMemAllocHost" 3020 false
        fn cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) -> CUresult => host::alloc_host_v2;
    Cuda "cuMemAllocHost" 2000 false
        fn cuMemAllocHost(pp: *mut *mut c_void, size: c_uint) -> CUresult => host::alloc_host_v1;
    Cuda "cuMemFreeHost" 2000 false fn cuMemFreeHost(p: *mut c_void) -> CUresult => host::free_host;
    Cuda "cuMemHostRegister" 4000 false
        fn cuMemHostRegister(p: *mut c_void, size: usize, flags: c_uint) -> CUresult => host::register_v1;
    Cuda "cuMemHostRegister" 6050 false
        fn cuMemHostRegister_v2(p: *mut c_void, size: usize, flags: c_uint) -> CUresult => host::register_v2;
    Cuda "cuMemHostUnregister" 4000 false fn cuMemHostUnregister(p: *mut c_void) -> CUresult => host::unregister;
    Cuda "cuIpcOpenMemHandle" 11000 false
        fn cuIpcOpenMemHandle_v2(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) -> CUresult
            => host::ipc_open_v2;
    Cuda "cuIpcOpenMemHandle" 4010 false
        fn cuIpcOpenMemHandle(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) -> CUresult
            => host::ipc_open_v1;
    Cuda "cuIpcCloseMemHandle" 4010 false fn cuIpcCloseMemHandle(dptr: CUdeviceptr) -> CUresult => host::ipc_close;

    // Memory no allocation returns (issue 24): modules and per-context limits.
    Cuda "cuModuleLoad" 2000 false fn cuModuleLoad(module: *mut CUmodule, fname: *const c_char) -> CUresult => modules::load_file;
    Cuda "cuModuleLoadData" 2000 false
        fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult => modules::load_data;
    Cuda "cuModuleLoadDataEx" 2010 false
        fn cuModuleLoadDataEx(module: *mut CUmodule, image: *const c_void, n: c_uint, options: *mut CUjit_option,
            values: *mut *mut c_void) -> CUresult => modules::load_data_ex;
    Cuda "cuModuleLoadFatBinary" 2000 false
        fn cuModuleLoadFatBinary(module: *mut CUmodule, fat: *const c_void) -> CUresult => modules::load_fat_binary;
    Cuda "cuModuleUnload" 2000 false fn cuModuleUnload(module: CUmodule) -> CUresult => modules::unload;
    Cuda "cuCtxSetLimit" 3010 false fn cuCtxSetLimit(limit: CUlimit, value: usize) -> CUresult => modules::set_limit;
    /// Libraries (CUDA 12.0) load into every context: measured on every device with one.
    Cuda "cuLibraryLoadData" 12000 false
        fn cuLibraryLoadData(lib: *mut CUlibrary, code: *const c_void, jit: *mut CUjit_option,
            jit_values: *mut *mut c_void, n_jit: c_uint, opts: *mut CUlibraryOption, opt_values: *mut *mut c_void,
            n_opts: c_uint) -> CUresult => libraries::load_data;
    Cuda "cuLibraryLoadFromFile" 12000 false
        fn cuLibraryLoadFromFile(lib: *mut CUlibrary, path: *const c_char, jit: *mut CUjit_option,
            jit_values: *mut *mut c_void, n_jit: c_uint, opts: *mut CUlibraryOption, opt_values: *mut *mut c_void,
            n_opts: c_uint) -> CUresult => libraries::load_from_file;
    Cuda "cuLibraryUnload" 12000 false fn cuLibraryUnload(lib: CUlibrary) -> CUresult => libraries::unload;

    // NVML's view agrees with cuMemGetInfo.
    Nvml "nvmlDeviceGetMemoryInfo" 0 false
        fn nvmlDeviceGetMemoryInfo(dev: nvmlDevice_t, mem: *mut nvmlMemory_t) -> nvmlReturn_t => nvml::memory_info;
    Nvml "nvmlDeviceGetMemoryInfo" 1 false
        fn nvmlDeviceGetMemoryInfo_v2(dev: nvmlDevice_t, mem: *mut nvmlMemory_v2_t) -> nvmlReturn_t => nvml::memory_info_v2;
}

import_table! {
    Cuda fn cuCtxGetDevice(*mut CUdevice) -> CUresult;
    Cuda fn cuDeviceGetCount(*mut c_int) -> CUresult;
    Cuda fn cuDeviceGet(*mut CUdevice, c_int) -> CUresult;
    Cuda fn cuDeviceGetUuid(*mut [u8; 16], CUdevice) -> CUresult;
    Cuda fn cuCtxGetCurrent(*mut CUcontext) -> CUresult;
    Cuda fn cuMemPoolGetAttribute(CUmemoryPool, c_int, *mut c_void) -> CUresult;
    Cuda fn cuDevicePrimaryCtxGetState(CUdevice, *mut c_uint, *mut c_int) -> CUresult;
    Cuda fn cuDevicePrimaryCtxRetain(*mut CUcontext, CUdevice) -> CUresult;
    Cuda fn cuDevicePrimaryCtxRelease_v2(CUdevice) -> CUresult;
    // Stream-ordered and graph memory: which device a stream is on, what a graph allocates.
    Cuda fn cuStreamGetDevice(CUstream, *mut CUdevice) -> CUresult;
    Cuda fn cuStreamGetCtx(CUstream, *mut CUcontext) -> CUresult;
    Cuda fn cuCtxGetDevice_v2(*mut CUdevice, CUcontext) -> CUresult;
    Cuda fn cuCtxPushCurrent_v2(CUcontext) -> CUresult;
    Cuda fn cuCtxPopCurrent_v2(*mut CUcontext) -> CUresult;
    Cuda fn cuStreamIsCapturing(CUstream, *mut c_int) -> CUresult;
    Cuda fn cuGraphGetNodes(CUgraph, *mut CUgraphNode, *mut usize) -> CUresult;
    Cuda fn cuGraphNodeGetType(CUgraphNode, *mut c_int) -> CUresult;
    Cuda fn cuGraphMemAllocNodeGetParams(CUgraphNode, *mut CUDA_MEM_ALLOC_NODE_PARAMS) -> CUresult;
    Cuda fn cuGraphMemFreeNodeGetParams(CUgraphNode, *mut CUdeviceptr) -> CUresult;
    Cuda fn cuGraphChildGraphNodeGetGraph(CUgraphNode, *mut CUgraph) -> CUresult;
    Cuda fn cuDeviceGetGraphMemAttribute(CUdevice, c_int, *mut c_void) -> CUresult;
    Nvml fn nvmlDeviceGetUUID(nvmlDevice_t, *mut c_char, c_uint) -> nvmlReturn_t;
    Nvml fn nvmlDeviceGetCount_v2(*mut c_uint) -> nvmlReturn_t;
    Nvml fn nvmlDeviceGetHandleByIndex_v2(c_uint, *mut nvmlDevice_t) -> nvmlReturn_t;
    Nvml fn nvmlDeviceGetPciInfo_v3(nvmlDevice_t, *mut nvmlPciInfo_t) -> nvmlReturn_t;
    // The driver's books (intercept::books): what NVML says this process uses.
    Nvml fn nvmlInit_v2() -> nvmlReturn_t;
    Nvml fn nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_t) -> nvmlReturn_t;
    Cuda fn cuCtxGetLimit(*mut usize, CUlimit) -> CUresult;
    // What a stack size costs: the device's resident threads (intercept::modules).
    Cuda fn cuDeviceGetAttribute(*mut c_int, c_int, CUdevice) -> CUresult;
    // Whether libraries load eagerly (intercept::libraries): the default changed in CUDA 12.2.
    Cuda fn cuDriverGetVersion(*mut c_int) -> CUresult;
}

/// Base names in the table whose unknown variants are safe to pass through: they only read a
/// view, synchronise, trace memory that is not counted, or end/begin lifetimes in a way whose
/// miss can only keep a charge too long (a detach or release we do not see leaves the charge in
/// place). A `cuGetProcAddress` answer for any *other* wrapped base name that is none of the
/// variants in the table is denied (see `intercept::procaddr`): memory must not go uncounted.
/// The list is of exceptions, so a name added to the table fails closed until someone decides
/// here, with a reason, that passing an unknown variant of it through cannot lose a charge.
pub const PASS_UNKNOWN_VARIANTS: &[&str] = &[
    "cuInit",
    "cuGetProcAddress",
    // Views: an unknown variant shows the physical figures, it cannot allocate.
    "cuMemGetInfo",
    "cuDeviceTotalMem",
    // Synchronisation: pools are re-read at the next counted call anyway.
    "cuCtxSynchronize",
    "cuStreamSynchronize",
    // Traced only (host memory, another process's memory, address ranges).
    "cuMemHostAlloc",
    "cuMemAllocHost",
    "cuMemFreeHost",
    "cuMemHostRegister",
    "cuMemHostUnregister",
    "cuIpcOpenMemHandle",
    "cuIpcCloseMemHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    // Context lifetimes: a create, attach, retain or release we miss leaves charges in place
    // (an unknown use count is never taken to reach zero).
    "cuCtxCreate",
    "cuCtxAttach",
    "cuCtxDetach",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease",
    "cuGreenCtxCreate",
    "cuCtxFromGreenCtx",
    "cuGreenCtxDestroy",
    // Pool look-ups and settings: an unregistered pool is matched or denied when it allocates.
    "cuDeviceGetDefaultMemPool",
    "cuDeviceGetMemPool",
    "cuMemGetDefaultMemPool",
    "cuMemGetMemPool",
    "cuMemPoolSetAttribute",
];

/// Whether an unknown variant of this wrapped base name could hand out or end counted memory
/// behind our back (every wrapped base name not in [`PASS_UNKNOWN_VARIANTS`]).
pub fn accounts(base: &[u8]) -> bool {
    HOOKS.iter().any(|h| h.lib == Lib::Cuda && h.base.as_bytes() == base)
        && !PASS_UNKNOWN_VARIANTS.iter().any(|b| b.as_bytes() == base)
}

/// The hook with this exported name.
pub fn find(name: &[u8]) -> Option<Hook> {
    HOOKS.iter().find(|h| h.name.as_bytes() == name).map(|h| h.hook)
}

/// The real driver function behind a hook (NULL when the driver lacks it).
pub fn real(h: Hook) -> *mut c_void {
    SLOTS[h as usize].get()
}

pub fn info(h: Hook) -> &'static HookInfo {
    &HOOKS[h as usize]
}

/// The exported name of the hook at index `api` (what an event's `api` field says).
pub fn api_name(api: u16) -> &'static str {
    HOOKS.get(api as usize).map_or("?", |h| h.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_consistent() {
        for (i, h) in HOOKS.iter().enumerate() {
            assert_eq!(h.hook as usize, i);
            assert_eq!(find(h.name.as_bytes()), Some(h.hook));
            assert!(h.name.starts_with(h.base), "{} is a variant of {}", h.name, h.base);
            assert!(!wrapper(h.hook).is_null());
            // Two variants of one base name must differ in version or stream flavour, or
            // cuGetProcAddress could not tell them apart.
            for other in &HOOKS[..i] {
                assert!(
                    !(other.base == h.base && other.since == h.since && other.per_thread == h.per_thread),
                    "{} and {} are indistinguishable",
                    other.name,
                    h.name
                );
            }
        }
        assert_eq!(find(b"cuMemAlloc_v3"), None);
    }

    #[test]
    fn every_pass_through_name_is_a_wrapped_base() {
        for b in PASS_UNKNOWN_VARIANTS {
            assert!(HOOKS.iter().any(|h| h.lib == Lib::Cuda && h.base == *b), "{b} is not a base name in HOOKS");
        }
        assert!(accounts(b"cuMemAlloc") && !accounts(b"cuMemGetInfo") && !accounts(b"cuMemAllo"));
        // Names that allocate or end memory fail closed without being listed anywhere.
        for b in ["cuMemRetainAllocationHandle", "cuMemExportToShareableHandle", "cuGraphLaunch", "cuGraphInstantiate", "cuMemFreeAsync", "cuCtxDestroy"] {
            assert!(accounts(b.as_bytes()), "{b}");
        }
    }
}
