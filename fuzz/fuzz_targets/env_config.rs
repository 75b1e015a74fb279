//! Every environment variable vramcap reads, as one environment: lines of `NAME=value` go to
//! `Config::from_vars` (VRAMCAP_LOG, VRAMCAP_DISABLE, VRAMCAP_LIMIT[_<i>], VRAMCAP_GROUP,
//! VRAMCAP_GROUP_LIMIT[_<i>], VRAMCAP_GROUP_DIR, CUDA_DEVICE_MEMORY_LIMIT[_<i>],
//! VRAMCAP_REAL_LIBCUDA, VRAMCAP_TRACE), then the limits are resolved against two devices the way
//! cuInit does. Input decoding: fuzz/src/env_input.rs.
#![no_main]
use libfuzzer_sys::fuzz_target;
use vramcap_fuzz::config::Config;
use vramcap_fuzz::limits::DeviceInfo;

fuzz_target!(|data: &[u8]| {
    let vars = vramcap_fuzz::env_input::vars(data);
    let c = Config::from_vars(&vars);
    if let Some(e) = &c.error {
        // Bad input names the variable and the expected form.
        let msg = e.to_string();
        assert!(msg.contains(&e.var) && msg.contains("expected"), "{msg}");
        return;
    }
    let devices = [
        DeviceInfo { total: 16 << 30, uuid: "GPU-8932f937-0000-1111-2222-333344445555".into() },
        DeviceInfo { total: 80 << 30, uuid: "GPU-0badc0de-0000-1111-2222-333344445555".into() },
    ];
    if let Ok(limits) = c.limits.resolve(&devices) {
        assert_eq!(limits.len(), devices.len());
    }
    if let Some(g) = &c.group {
        let _ = g.limits.resolve(&devices);
    }
});
