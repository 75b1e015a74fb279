//! NVML before (or without) CUDA: `nvidia-smi` in a preloaded container, pynvml-based tools, and
//! frameworks that count devices through NVML so as not to initialise CUDA before `fork` must see
//! the cap too. vramcap never initialises CUDA from inside an NVML call, so until CUDA is up it
//! works out which CUDA ordinal an NVML device will be from NVML alone: devices in PCI bus order
//! (CUDA's order with `CUDA_DEVICE_ORDER=PCI_BUS_ID`), renumbered through `CUDA_VISIBLE_DEVICES`
//! exactly as CUDA does. UUID keys and uniform limits need no ordinal guess at all. Where this
//! can differ from CUDA's own numbering is in docs/configuration.md.

use crate::config::{self, limits::DeviceInfo};
use crate::ffi::*;
use crate::hooks::{import, real};
use crate::ledger;
use std::ffi::{CStr, c_char};

/// The CUDA devices `CUDA_VISIBLE_DEVICES` leaves, as indices into `uuids` (the GPUs in PCI bus
/// order). CUDA's rules: a list of indices or UUIDs (`GPU-…`, a unique prefix is enough);
/// enumeration stops at the first entry that names no device (or names one again); unset means
/// all. `None`: an entry this cannot map without CUDA (a MIG instance).
pub fn visible_order(uuids: &[String], cvd: Option<&str>) -> Option<Vec<usize>> {
    let Some(cvd) = cvd else { return Some((0..uuids.len()).collect()) };
    let mut out = Vec::new();
    for entry in cvd.split(',').map(str::trim) {
        let lower = entry.to_ascii_lowercase();
        if lower.starts_with("mig-") {
            return None;
        }
        let found = if let Ok(i) = entry.parse::<usize>() {
            (i < uuids.len()).then_some(i)
        } else if lower.starts_with("gpu-") {
            let mut hits = uuids.iter().enumerate().filter(|(_, u)| u.to_ascii_lowercase().starts_with(&lower));
            match (hits.next(), hits.next()) {
                (Some((i, _)), None) => Some(i),
                _ => None,
            }
        } else {
            None
        };
        match found {
            Some(i) if !out.contains(&i) => out.push(i),
            _ => break,
        }
    }
    Some(out)
}

/// Whether CUDA is initialised in this process. Never loads or initialises the driver: a driver
/// that is not loaded yet is certainly not up, and `cuDeviceGetCount` answers
/// `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`.
pub fn cuda_is_up() -> bool {
    if !crate::dl::driver_loaded() {
        return false;
    }
    let Some(f) = import::cuDeviceGetCount() else { return false };
    let mut n = 0;
    unsafe { f(&mut n) == CUDA_SUCCESS }
}

struct NvmlGpu {
    handle: nvmlDevice_t,
    uuid: String,
    bus: (u32, u32, u32),
    total: u64,
}

fn nvml_gpus() -> Option<Vec<NvmlGpu>> {
    let (count_fn, handle_fn, pci_fn, uuid_fn, mem_fn) = (
        import::nvmlDeviceGetCount_v2()?,
        import::nvmlDeviceGetHandleByIndex_v2()?,
        import::nvmlDeviceGetPciInfo_v3()?,
        import::nvmlDeviceGetUUID()?,
        real::nvmlDeviceGetMemoryInfo()?,
    );
    let mut n = 0;
    if unsafe { count_fn(&mut n) } != NVML_SUCCESS {
        return None;
    }
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n.min(ledger::MAX_DEVICES as u32 * 4) {
        let mut handle: nvmlDevice_t = std::ptr::null_mut();
        let mut pci: nvmlPciInfo_t = unsafe { std::mem::zeroed() };
        let mut buf = [0 as c_char; 96];
        let mut mem = nvmlMemory_t { total: 0, free: 0, used: 0 };
        let ok = unsafe {
            handle_fn(i, &mut handle) == NVML_SUCCESS
                && pci_fn(handle, &mut pci) == NVML_SUCCESS
                && uuid_fn(handle, buf.as_mut_ptr(), buf.len() as u32) == NVML_SUCCESS
                && mem_fn(handle, &mut mem) == NVML_SUCCESS
        };
        if !ok {
            return None;
        }
        let uuid = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().ok()?.to_string();
        out.push(NvmlGpu { handle, uuid, bus: (pci.domain, pci.bus, pci.device), total: mem.total });
    }
    out.sort_by_key(|g| g.bus);
    Some(out)
}

/// The capped (total, free, used) of NVML device `dev` before CUDA is up, or `None` for the
/// physical view (no cap applies to it, or it is not a device this process's CUDA will see).
pub fn capped(dev: nvmlDevice_t, phys_total: u64, phys_free: u64) -> Option<(u64, u64, u64)> {
    let cfg = config::get();
    let group = cfg.group.as_ref().map(|g| &g.limits).filter(|l| !l.is_empty());
    if cfg.limits.is_empty() && cfg.group.is_none() {
        return None;
    }
    // Observe mode shows the physical device; in a group only once it has joined (the group may
    // enforce), so not here.
    if crate::observe::configured() && cfg.group.is_none() {
        return None;
    }
    let gpus = nvml_gpus()?;
    let uuids: Vec<String> = gpus.iter().map(|g| g.uuid.clone()).collect();
    let cvd = match std::env::var_os("CUDA_VISIBLE_DEVICES") {
        None => None,
        Some(v) => Some(v.into_string().ok()?),
    };
    let order = visible_order(&uuids, cvd.as_deref())?;
    let ordinal = order.iter().position(|&i| gpus[i].handle == dev)?;
    let devices: Vec<DeviceInfo> =
        order.iter().map(|&i| DeviceInfo { total: gpus[i].total, uuid: gpus[i].uuid.clone() }).collect();
    // A spec that does not resolve here fails CUDA initialisation later (nothing will be handed
    // out): NVML says so now, as `cuMemGetInfo` will.
    // Each cap that applies, with what counts against it: the process's own charge; and the
    // group's budget with what all its members hold, read from its ledger without joining it
    // (a tool that never starts CUDA sees what the group's jobs hold). The ledger's budget is
    // the group's (members and operators may have changed it since this configuration).
    let own = ledger::charged(ordinal);
    let resolve = |spec: &config::limits::LimitSpec| spec.resolve(&devices).map(|r| r[ordinal]);
    let Ok(own_limit) = resolve(&cfg.limits) else { return Some((phys_total, 0, phys_total)) };
    let Ok(group_limit) = group.map_or(Ok(0), resolve) else { return Some((phys_total, 0, phys_total)) };
    let mut caps: Vec<(u64, u64)> = Vec::new();
    if own_limit > 0 {
        caps.push((own_limit, own));
    }
    match cfg.group.as_ref().and_then(|g| crate::group::peek::peek(g, &devices[ordinal].uuid)) {
        Some((budget, held)) if budget > 0 => caps.push((budget, held.max(own))),
        Some((_, held)) if group_limit > 0 => caps.push((group_limit, held.max(own))),
        _ if group_limit > 0 => caps.push((group_limit, own)),
        _ => {}
    }
    if caps.is_empty() {
        return None;
    }
    let (total, free) = caps.iter().fold((phys_total, phys_free), |(t, f), &(l, used)| {
        let lt = l.min(phys_total);
        (t.min(lt), f.min(lt.saturating_sub(used)))
    });
    Some((total, free, total - free))
}

#[cfg(test)]
mod tests {
    use super::visible_order;

    fn uuids() -> Vec<String> {
        ["GPU-8932f937-aaaa", "GPU-8932f938-bbbb", "GPU-11111111-cccc"].iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn cuda_visible_devices_renumbers_like_cuda() {
        let u = uuids();
        assert_eq!(visible_order(&u, None), Some(vec![0, 1, 2]));
        assert_eq!(visible_order(&u, Some("1,0")), Some(vec![1, 0]));
        assert_eq!(visible_order(&u, Some("2")), Some(vec![2]));
        assert_eq!(visible_order(&u, Some("")), Some(vec![]), "empty: no device");
        assert_eq!(visible_order(&u, Some("0,7,1")), Some(vec![0]), "stops at the first invalid entry");
        assert_eq!(visible_order(&u, Some("1,1,2")), Some(vec![1]), "a repeat is invalid");
        assert_eq!(visible_order(&u, Some("GPU-8932f938,0")), Some(vec![1, 0]), "UUID prefixes");
        assert_eq!(visible_order(&u, Some("gpu-8932F93,2")), Some(vec![]), "an ambiguous prefix is invalid");
        assert_eq!(visible_order(&u, Some(" 2 , 0 ")), Some(vec![2, 0]));
        assert_eq!(visible_order(&u, Some("MIG-1234")), None, "MIG cannot be mapped without CUDA");
    }
}
