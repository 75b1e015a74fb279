//! The doctor's probes, each run in a child process (`vramcap doctor --probe KIND`) that prints
//! `key=value` lines:
//!
//! - `driver`: loads the driver the way vramcap would (`VRAMCAP_REAL_LIBCUDA` or
//!   `libcuda.so.1`), without the preload: its file, version, `cuInit` result and devices.
//! - `intercept`: started under `LD_PRELOAD=libvramcap.so` with a small `VRAMCAP_LIMIT`; reaches
//!   the driver the way the CUDA runtime does (`dlopen`, `dlsym("cuGetProcAddress_v2")`, every
//!   other function through it) and reports which library the `cuMemAlloc` it got lives in, the
//!   total `cuMemGetInfo` shows, and what an allocation over and under the cap returned.
//! - `preloaded`: started with the environment's own `LD_PRELOAD`: whether the loader mapped
//!   vramcap's library (a bare name that does not resolve, a path that is not readable: not).

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};

type CUresult = c_int;

pub struct ProbeDevice {
    pub index: u32,
    pub name: String,
    pub total: u64,
    pub uuid: String,
}

/// A probe's answer as the doctor reads it.
#[derive(Default)]
pub struct Probe {
    kv: HashMap<String, String>,
    pub devices: Vec<ProbeDevice>,
}

impl Probe {
    pub fn parse(stdout: &str, _stderr: &str) -> Probe {
        let mut p = Probe::default();
        for line in stdout.lines() {
            if let Some(rest) = line.strip_prefix("device ") {
                // device index=0 total=N uuid=GPU-... name=rest of the line
                let (head, name) = rest.split_once(" name=").unwrap_or((rest, ""));
                let f: HashMap<&str, &str> = head.split_whitespace().filter_map(|w| w.split_once('=')).collect();
                p.devices.push(ProbeDevice {
                    index: f.get("index").and_then(|v| v.parse().ok()).unwrap_or(0),
                    total: f.get("total").and_then(|v| v.parse().ok()).unwrap_or(0),
                    uuid: f.get("uuid").unwrap_or(&"").to_string(),
                    name: name.to_string(),
                });
            } else if let Some((k, v)) = line.split_once('=') {
                p.kv.insert(k.to_string(), v.to_string());
            }
        }
        p
    }
    pub fn get(&self, k: &str) -> Option<&str> {
        self.kv.get(k).map(String::as_str)
    }
    pub fn num(&self, k: &str) -> Option<u64> {
        self.get(k)?.parse().ok()
    }
}

/// Names of the results a doctor line may quote (NVIDIA's driver API documentation, CUresult).
pub fn result_name(rc: u64) -> String {
    let n = match rc {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        35 => "CUDA_ERROR_INSUFFICIENT_DRIVER",
        46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        _ => return format!("CUresult {rc}"),
    };
    format!("{n} ({rc})")
}

/// The driver the library would open; the raw bytes (a path need not be UTF-8, and the library
/// refuses a value that is not, which the doctor reports under "limits").
fn driver_name() -> std::ffi::OsString {
    std::env::var_os("VRAMCAP_REAL_LIBCUDA").filter(|v| !v.is_empty()).unwrap_or_else(|| "libcuda.so.1".into())
}

fn dlerr() -> String {
    let e = unsafe { libc::dlerror() };
    if e.is_null() { "unknown error".into() } else { unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned() }
}

/// The file a loaded function lives in.
fn file_of(f: *const c_void) -> String {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    if f.is_null() || unsafe { libc::dladdr(f, &mut info) } == 0 || info.dli_fname.is_null() {
        return "?".into();
    }
    unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned()
}

fn open_driver() -> Result<*mut c_void, i32> {
    let name = driver_name();
    println!("lib={}", name.to_string_lossy());
    let c = CString::new(name.into_encoded_bytes()).map_err(|_| {
        println!("error=VRAMCAP_REAL_LIBCUDA contains a NUL byte");
        3
    })?;
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        println!("error=cannot load it: {}", dlerr());
        return Err(3);
    }
    Ok(h)
}

fn sym(h: *mut c_void, name: &str) -> *mut c_void {
    let c = CString::new(name).unwrap();
    unsafe { libc::dlsym(h, c.as_ptr()) }
}

/// `(ptr as fn type)` for a non-null symbol, or an `error=` line and exit status 3.
macro_rules! need {
    ($p:expr, $name:expr, $t:ty) => {{
        let p = $p;
        if p.is_null() {
            println!("error=the driver has no {}", $name);
            return 3;
        }
        unsafe { std::mem::transmute::<*mut c_void, $t>(p) }
    }};
}

fn uuid_string(b: &[u8; 16]) -> String {
    let h: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", h[0..4].concat(), h[4..6].concat(), h[6..8].concat(), h[8..10].concat(), h[10..16].concat())
}

fn driver() -> i32 {
    let h = match open_driver() {
        Ok(h) => h,
        Err(c) => return c,
    };
    let init = sym(h, "cuInit");
    println!("path={}", file_of(init));
    let init = need!(init, "cuInit", extern "C" fn(c_uint) -> CUresult);
    let version = need!(sym(h, "cuDriverGetVersion"), "cuDriverGetVersion", extern "C" fn(*mut c_int) -> CUresult);
    let count = need!(sym(h, "cuDeviceGetCount"), "cuDeviceGetCount", extern "C" fn(*mut c_int) -> CUresult);
    let get = need!(sym(h, "cuDeviceGet"), "cuDeviceGet", extern "C" fn(*mut c_int, c_int) -> CUresult);
    let name = need!(sym(h, "cuDeviceGetName"), "cuDeviceGetName", extern "C" fn(*mut c_char, c_int, c_int) -> CUresult);
    let total = need!(sym(h, "cuDeviceTotalMem_v2"), "cuDeviceTotalMem_v2", extern "C" fn(*mut usize, c_int) -> CUresult);
    let uuid = need!(sym(h, "cuDeviceGetUuid"), "cuDeviceGetUuid", extern "C" fn(*mut [u8; 16], c_int) -> CUresult);
    let mut v = 0;
    if version(&mut v) == 0 {
        println!("version={v}");
    }
    let rc = init(0);
    println!("init={rc}");
    if rc != 0 {
        return 0;
    }
    let mut n = 0;
    if count(&mut n) != 0 {
        println!("error=cuDeviceGetCount failed");
        return 3;
    }
    for i in 0..n {
        let mut d = 0;
        if get(&mut d, i) != 0 {
            continue;
        }
        let mut buf = [0 as c_char; 256];
        let nm = if name(buf.as_mut_ptr(), 256, d) == 0 {
            unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
        } else {
            "?".into()
        };
        let mut t = 0usize;
        let mut u = [0u8; 16];
        let _ = total(&mut t, d);
        let us = if uuid(&mut u, d) == 0 { uuid_string(&u) } else { "GPU-?".into() };
        println!("device index={i} total={t} uuid={us} name={nm}");
    }
    0
}

fn intercept() -> i32 {
    type GetProc = extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;
    let h = match open_driver() {
        Ok(h) => h,
        Err(c) => return c,
    };
    let gp = need!(sym(h, "cuGetProcAddress_v2"), "cuGetProcAddress_v2", GetProc);
    let get = |base: &str, ver: c_int| -> *mut c_void {
        let c = CString::new(base).unwrap();
        let mut p = std::ptr::null_mut();
        let mut st = -1;
        if gp(c.as_ptr(), &mut p, ver, 0, &mut st) != 0 || st != 0 { std::ptr::null_mut() } else { p }
    };
    let init = need!(get("cuInit", 2000), "cuInit", extern "C" fn(c_uint) -> CUresult);
    let retain = need!(get("cuDevicePrimaryCtxRetain", 7000), "cuDevicePrimaryCtxRetain", extern "C" fn(*mut *mut c_void, c_int) -> CUresult);
    let set = need!(get("cuCtxSetCurrent", 4000), "cuCtxSetCurrent", extern "C" fn(*mut c_void) -> CUresult);
    let alloc_p = get("cuMemAlloc", 3020);
    println!("alloc_from={}", file_of(alloc_p));
    let alloc = need!(alloc_p, "cuMemAlloc", extern "C" fn(*mut u64, usize) -> CUresult);
    let free = need!(get("cuMemFree", 3020), "cuMemFree", extern "C" fn(u64) -> CUresult);
    let info = need!(get("cuMemGetInfo", 3020), "cuMemGetInfo", extern "C" fn(*mut usize, *mut usize) -> CUresult);
    let rc = init(0);
    if rc != 0 {
        println!("error=cuInit under the preload returned {}", result_name(rc as u64));
        return 3;
    }
    let mut ctx = std::ptr::null_mut();
    if retain(&mut ctx, 0) != 0 || set(ctx) != 0 {
        println!("error=cannot create a context on device 0");
        return 3;
    }
    let (mut f, mut t) = (0usize, 0usize);
    if info(&mut f, &mut t) == 0 {
        println!("info_total={t}");
    }
    let cap: usize = std::env::var("VRAMCAP_LIMIT").ok().and_then(|v| v.parse().ok()).unwrap_or(64 << 20);
    let mut p = 0u64;
    let rc = alloc(&mut p, cap + (1 << 20));
    println!("over_rc={rc}");
    if rc == 0 {
        free(p);
    }
    let rc = alloc(&mut p, 1 << 20);
    println!("under_rc={rc}");
    if rc == 0 {
        println!("free_rc={}", free(p));
    }
    0
}

/// `preloaded`: started with the environment's `LD_PRELOAD` (and /etc/ld.so.preload): did the
/// loader map vramcap's library into this process? Prints `mapped=PATH`, or nothing.
fn preloaded() -> i32 {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let found = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| {
        std::path::Path::new(p).file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libvramcap") && n.contains(".so"))
    });
    if let Some(p) = found {
        println!("mapped={p}");
    }
    0
}

/// Runs one probe; the exit status for the child.
pub fn run(kind: &str) -> i32 {
    match kind {
        "driver" => driver(),
        "intercept" => intercept(),
        "preloaded" => preloaded(),
        other => {
            eprintln!("vramcap: doctor: unknown probe {other:?}; expected driver, intercept or preloaded");
            2
        }
    }
}
