//! `cuInit` and the one-time resolution of limits against the devices this process sees.
//!
//! Percent limits need each device's total and UUID keys need each device's UUID, so limits
//! are resolved once the driver is initialised: right after the real `cuInit` succeeds, or
//! lazily by the first wrapper that needs them.

use super::{MISSING_REAL, Mode, mode};
use crate::config::{self, Level, limits::DeviceInfo, size::human};
use crate::ffi::*;
use crate::hooks::{import, real};
use crate::ledger;
use crate::log::log_at;
use std::ffi::c_uint;
use std::sync::atomic::{AtomicU8, Ordering};

const UNRESOLVED: u8 = 0;
const RESOLVED: u8 = 1;
const INVALID: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(UNRESOLVED);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitsError {
    /// The driver cannot tell us about devices yet (not initialised).
    NotYet,
    /// The configuration names something that does not exist: fail closed.
    Invalid,
}

impl LimitsError {
    /// What a wrapper that needed the limits returns instead of calling the driver.
    pub fn code(self) -> CUresult {
        match self {
            LimitsError::NotYet => CUDA_ERROR_NOT_INITIALIZED,
            LimitsError::Invalid => CUDA_ERROR_NOT_PERMITTED,
        }
    }
}

pub unsafe fn cu_init(flags: c_uint) -> CUresult {
    let Some(real_init) = real::cuInit() else { return MISSING_REAL };
    match mode() {
        Mode::PassThrough => return unsafe { real_init(flags) },
        // The message was printed when the configuration was read.
        Mode::FailClosed => return CUDA_ERROR_NOT_PERMITTED,
        Mode::Enforce => {}
    }
    let rc = unsafe { real_init(flags) };
    if rc == CUDA_SUCCESS && super::guarded(Err(LimitsError::Invalid), ensure_limits) == Err(LimitsError::Invalid) {
        return CUDA_ERROR_NOT_PERMITTED;
    }
    rc
}

/// Limits are in the ledger (cheap after the first call).
#[inline]
pub fn ensure_limits() -> Result<(), LimitsError> {
    match STATE.load(Ordering::Acquire) {
        RESOLVED => Ok(()),
        INVALID => Err(LimitsError::Invalid),
        _ => resolve(),
    }
}

#[cold]
fn resolve() -> Result<(), LimitsError> {
    let cfg = config::get();
    let devices = query_devices();
    if let Some(d) = &devices {
        ledger::set_devices(&d.iter().map(|d| d.total).collect::<Vec<_>>());
    }
    if cfg.limits.is_empty() && cfg.group.is_none() {
        STATE.store(RESOLVED, Ordering::Release);
        return Ok(());
    }
    let devices = devices.ok_or(LimitsError::NotYet)?;
    match apply(cfg, &devices) {
        Ok(()) => {
            STATE.store(RESOLVED, Ordering::Release);
            Ok(())
        }
        Err(e) => {
            if STATE.swap(INVALID, Ordering::AcqRel) != INVALID {
                crate::log::write_line(&format!(
                    "vramcap: {e}. Refusing to run uncapped: no device memory will be handed out."
                ));
            }
            Err(LimitsError::Invalid)
        }
    }
}

/// Per-process limits into the ledger, then the group joined (its file opened or created).
/// Racing resolvers compute the same values; doing it twice is harmless.
fn apply(cfg: &config::Config, devices: &[DeviceInfo]) -> Result<(), String> {
    let mut limits = cfg.limits.resolve(devices).map_err(|e| e.to_string())?;
    if let Some(c) = &cfg.ceiling {
        let ceiling = c.limits.resolve(devices).map_err(|e| e.to_string())?;
        say_capped(&cfg.limits, &c.path, config::ceiling::cap(&mut limits, &ceiling), &ceiling);
        crate::observe::set_from_ceiling(&limits, &ceiling);
    }
    for (d, &l) in limits.iter().enumerate() {
        ledger::set_limit(d, l);
        if l > 0 {
            log_at!(Level::Info, "device {d}: limit {} of {}", human(l), human(devices[d].total));
        }
    }
    if let Some(g) = &cfg.group {
        let mut glimits = if g.limits.is_empty() { None } else { Some(g.limits.resolve(devices).map_err(|e| e.to_string())?) };
        let mut gceiling = None;
        if let Some(c) = &cfg.ceiling
            && !c.group_limits.is_empty()
        {
            let ceiling = c.group_limits.resolve(devices).map_err(|e| e.to_string())?;
            if let Some(gl) = glimits.as_mut() {
                say_capped(&g.limits, &c.path, config::ceiling::cap(gl, &ceiling), &ceiling);
            }
            gceiling = Some(ceiling);
        }
        crate::group::attach(g, devices, glimits.as_deref(), gceiling.as_deref())?;
        log_at!(Level::Info, "group \"{}\": joined", crate::group::name().unwrap_or(""));
    }
    if cfg.ceiling.is_some() || cfg.group.is_some() {
        crate::ceiling_watch::start(devices, cfg.ceiling.is_some());
    }
    Ok(())
}

/// One line for the setting (the variables the user set, as named) that asked above the
/// platform's ceiling, however many devices it was above on: not one per device (eight lines on
/// an eight-GPU node said one thing).
fn say_capped(spec: &config::limits::LimitSpec, path: &str, devices: Vec<usize>, ceiling: &[u64]) {
    if devices.is_empty() {
        return;
    }
    let mut vars: Vec<&str> = Vec::new();
    for e in &spec.entries {
        if !vars.contains(&e.var.as_str()) {
            vars.push(&e.var);
        }
    }
    crate::log::write_line(&format!(
        "vramcap: {} above the ceiling in {path} ({}): using the ceiling (the environment can only lower it)",
        vars.join(", "),
        config::ceiling::describe_devices(&devices, ceiling)
    ));
}

fn query_devices() -> Option<Vec<DeviceInfo>> {
    let (count_fn, get_fn, total_fn) = (import::cuDeviceGetCount()?, import::cuDeviceGet()?, real::cuDeviceTotalMem_v2()?);
    let mut count = 0;
    if unsafe { count_fn(&mut count) } != CUDA_SUCCESS {
        return None;
    }
    let count = (count.max(0) as usize).min(ledger::MAX_DEVICES);
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let mut dev: CUdevice = 0;
        if unsafe { get_fn(&mut dev, i as i32) } != CUDA_SUCCESS {
            return None;
        }
        let mut total = 0usize;
        if unsafe { total_fn(&mut total, dev) } != CUDA_SUCCESS {
            return None;
        }
        let mut uuid = [0u8; 16];
        let uuid = match import::cuDeviceGetUuid() {
            Some(f) if unsafe { f(&mut uuid, dev) } == CUDA_SUCCESS => format_uuid(&uuid),
            _ => String::new(),
        };
        out.push(DeviceInfo { total: total as u64, uuid });
    }
    Some(out)
}

/// `GPU-8932f937-...`, the form `nvidia-smi -L` and Kubernetes device plugins print.
pub fn format_uuid(b: &[u8; 16]) -> String {
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

#[cfg(test)]
mod tests {
    #[test]
    fn uuid_format() {
        let mut b = [0u8; 16];
        b[..4].copy_from_slice(&[0x89, 0x32, 0xf9, 0x37]);
        b[15] = 0xab;
        assert_eq!(super::format_uuid(&b), "GPU-8932f937-0000-0000-0000-0000000000ab");
    }
}
