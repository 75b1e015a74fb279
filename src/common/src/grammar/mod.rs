//! The limit grammar: sizes (`8GiB`, `50%`), per-device lists (`0=8GiB,GPU-8932f937=4g`) and the
//! variable families that carry them (`VRAMCAP_LIMIT[_<i>]`, `VRAMCAP_GROUP[_LIMIT]`, HAMi-core's
//! `CUDA_DEVICE_MEMORY_LIMIT`); the names vramcap reads, group names and job ids. Pure parsing,
//! no driver, no I/O: the one parser behind the library's configuration and every command of the
//! `vramcap` binary (`run`, `replay`, `size`, `doctor`).

pub mod group;
pub mod group_name;
pub mod job;
pub mod limits;
pub mod names;
pub mod size;
