//! CUDA arrays (textures, surfaces): charged the bytes their descriptor describes, keyed by handle.
//! Element sizes come from the documented `CUarray_format` values; a format we do not know is
//! charged 16 bytes per channel element (the largest element) so that it is never under-counted.

use super::charge::{self, Target};
use super::MISSING_REAL;
use crate::ffi::*;
use crate::hooks::{Hook, real};
use crate::ledger::Kind;
use std::ffi::c_uint;

fn element_bytes(format: i32) -> u64 {
    match format {
        0x01 | 0x08 => 1,        // (UN)SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // (UN)SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // (UN)SIGNED_INT32, FLOAT
        _ => 16,
    }
}

/// `CUDA_ARRAY3D_LAYERED`, `CUDA_ARRAY3D_CUBEMAP`: `Depth` counts layers (cube faces), not depth.
const LAYERS: u32 = 0x01 | 0x04;
/// `CUDA_ARRAY3D_SPARSE`, `CUDA_ARRAY3D_DEFERRED_MAPPING`: documented as allocated without physical
/// backing; their tiles (or whole array) are later backed by `cuMemMapArrayAsync` with memory from
/// `cuMemCreate`, which is charged where it is created.
const UNBACKED: u32 = 0x40 | 0x80;

/// Bytes of a (mipmapped) array: the sum over levels, each dimension halved per level, an absent
/// dimension (0) counted as 1. The layer count of a layered or cubemap array is kept at every level
/// (each level has every layer); an array without physical backing costs nothing.
pub fn array_bytes(w: usize, h: usize, d: usize, format: i32, channels: u32, levels: u32, flags: u32) -> u64 {
    if flags & UNBACKED != 0 {
        return 0;
    }
    let per = element_bytes(format).saturating_mul(channels.max(1) as u64);
    (0..clamp_levels(w, h, d, levels))
        .map(|l| {
            let dim = |v: usize| ((v as u64) >> l).max(1);
            let depth = if flags & LAYERS != 0 { (d as u64).max(1) } else { dim(d) };
            dim(w).saturating_mul(dim(h)).saturating_mul(depth).saturating_mul(per)
        })
        .fold(0u64, u64::saturating_add)
}

/// The levels a mipmapped array gets: `cuMipmappedArrayCreate` clamps the count asked for to
/// [1, 1 + floor(log2(max(width, height, depth)))]. Counting past that would over-charge (a level
/// shift of 64 or more wraps back to full size) and loop up to `u32::MAX` times.
fn clamp_levels(w: usize, h: usize, d: usize, levels: u32) -> u32 {
    let top = 64 - (w.max(h).max(d).max(1) as u64).leading_zeros();
    levels.clamp(1, top)
}

/// Charges `size`, or, for an array without physical backing, calls the driver alone (it takes
/// no memory: there is nothing to reserve, and the handle is never a charge's key).
fn create(api: Hook, size: u64, flags: u32, call: impl FnOnce() -> CUresult, key: impl FnOnce() -> u64) -> CUresult {
    if flags & UNBACKED != 0 {
        return call();
    }
    charge::alloc(api, Kind::Array, Target::CurrentContext, size, call, key)
}

pub unsafe fn create_2d(arr: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) -> CUresult {
    let Some(f) = real::cuArrayCreate_v2() else { return MISSING_REAL };
    let call = || unsafe { f(arr, desc) };
    if desc.is_null() || arr.is_null() {
        return call();
    }
    let d = unsafe { &*desc };
    let size = array_bytes(d.width, d.height, 0, d.format, d.num_channels, 1, 0);
    charge::alloc(Hook::cuArrayCreate_v2, Kind::Array, Target::CurrentContext, size, call, || unsafe { *arr as u64 })
}

pub unsafe fn create_3d(arr: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult {
    let Some(f) = real::cuArray3DCreate_v2() else { return MISSING_REAL };
    let call = || unsafe { f(arr, desc) };
    if desc.is_null() || arr.is_null() {
        return call();
    }
    let d = unsafe { &*desc };
    let size = array_bytes(d.width, d.height, d.depth, d.format, d.num_channels, 1, d.flags);
    create(Hook::cuArray3DCreate_v2, size, d.flags, call, || unsafe { *arr as u64 })
}

pub unsafe fn create_2d_v1(arr: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR_v1) -> CUresult {
    let Some(f) = real::cuArrayCreate() else { return MISSING_REAL };
    let call = || unsafe { f(arr, desc) };
    if desc.is_null() || arr.is_null() {
        return call();
    }
    let d = unsafe { &*desc };
    let size = array_bytes(d.width as usize, d.height as usize, 0, d.format, d.num_channels, 1, 0);
    charge::alloc(Hook::cuArrayCreate, Kind::Array, Target::CurrentContext, size, call, || unsafe { *arr as u64 })
}

pub unsafe fn create_3d_v1(arr: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR_v1) -> CUresult {
    let Some(f) = real::cuArray3DCreate() else { return MISSING_REAL };
    let call = || unsafe { f(arr, desc) };
    if desc.is_null() || arr.is_null() {
        return call();
    }
    let d = unsafe { &*desc };
    let size = array_bytes(d.width as usize, d.height as usize, d.depth as usize, d.format, d.num_channels, 1, d.flags);
    create(Hook::cuArray3DCreate, size, d.flags, call, || unsafe { *arr as u64 })
}

pub unsafe fn create_mipmapped(arr: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) -> CUresult {
    let Some(f) = real::cuMipmappedArrayCreate() else { return MISSING_REAL };
    let call = || unsafe { f(arr, desc, levels) };
    if desc.is_null() || arr.is_null() {
        return call();
    }
    let d = unsafe { &*desc };
    let size = array_bytes(d.width, d.height, d.depth, d.format, d.num_channels, levels, d.flags);
    create(Hook::cuMipmappedArrayCreate, size, d.flags, call, || unsafe { *arr as u64 })
}

pub unsafe fn destroy(arr: CUarray) -> CUresult {
    let Some(f) = real::cuArrayDestroy() else { return MISSING_REAL };
    charge::free(Hook::cuArrayDestroy, Kind::Array, arr as u64, || unsafe { f(arr) })
}

pub unsafe fn destroy_mipmapped(arr: CUmipmappedArray) -> CUresult {
    let Some(f) = real::cuMipmappedArrayDestroy() else { return MISSING_REAL };
    charge::free(Hook::cuMipmappedArrayDestroy, Kind::Array, arr as u64, || unsafe { f(arr) })
}

#[cfg(test)]
mod tests {
    use super::array_bytes;

    #[test]
    fn descriptor_bytes() {
        assert_eq!(array_bytes(1024, 0, 0, 0x20, 4, 1, 0), 1024 * 16);
        assert_eq!(array_bytes(1024, 512, 0, 0x01, 1, 1, 0), 1024 * 512);
        assert_eq!(array_bytes(64, 64, 64, 0x02, 2, 1, 0), 64 * 64 * 64 * 4);
        // 8x8 float, 4 levels: 64 + 16 + 4 + 1 texels.
        assert_eq!(array_bytes(8, 8, 0, 0x20, 1, 4, 0), (64 + 16 + 4 + 1) * 4);
        assert_eq!(array_bytes(4, 0, 0, 0x7f, 1, 1, 0), 4 * 16, "unknown formats are never under-counted");
        // Layered (10 layers) and cubemap (6 faces), 8x8 float, 4 levels: every level has every layer.
        assert_eq!(array_bytes(8, 8, 10, 0x20, 1, 4, 0x01), (64 + 16 + 4 + 1) * 4 * 10);
        assert_eq!(array_bytes(8, 8, 6, 0x20, 1, 4, 0x04), (64 + 16 + 4 + 1) * 4 * 6);
        assert_eq!(array_bytes(8, 8, 12, 0x20, 1, 4, 0x05), (64 + 16 + 4 + 1) * 4 * 12);
        // A 3D mipmapped array still halves its depth.
        assert_eq!(array_bytes(8, 8, 8, 0x20, 1, 4, 0), (512 + 64 + 8 + 1) * 4);
        // Level counts are clamped to [1, 1 + floor(log2(max dimension))]: 8x8 has 4 levels.
        assert_eq!(array_bytes(8, 8, 0, 0x20, 1, 0, 0), 64 * 4);
        assert_eq!(array_bytes(8, 8, 0, 0x20, 1, 65, 0), (64 + 16 + 4 + 1) * 4);
        assert_eq!(array_bytes(8, 8, 0, 0x20, 1, u32::MAX, 0), (64 + 16 + 4 + 1) * 4);
        assert_eq!(array_bytes(4096, 4096, 64, 0x20, 4, 1, 0x40), 0, "sparse: no backing");
        assert_eq!(array_bytes(4096, 4096, 64, 0x20, 4, 1, 0x80), 0, "deferred mapping: no backing");
    }
}
