//! How `env_config` turns fuzzer bytes into an environment; also compiled by
//! tests/cli/fuzz_regressions.rs so saved inputs replay exactly. Lines of `NAME=value`; a name that
//! is a single digit stands for one of the real names, so the fuzzer reaches every parser
//! without having to spell them.

pub const NAMES: [&str; 10] = [
    "VRAMCAP_LIMIT",
    "VRAMCAP_LIMIT_1",
    "VRAMCAP_GROUP",
    "VRAMCAP_GROUP_LIMIT",
    "VRAMCAP_GROUP_LIMIT_0",
    "CUDA_DEVICE_MEMORY_LIMIT",
    "CUDA_DEVICE_MEMORY_LIMIT_1",
    "VRAMCAP_LOG",
    "VRAMCAP_DISABLE",
    "VRAMCAP_TRACE",
];

pub fn vars(data: &[u8]) -> Vec<(String, String)> {
    String::from_utf8_lossy(data)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| {
            let k = match k.as_bytes() {
                [d @ b'0'..=b'9'] => NAMES[(d - b'0') as usize].to_string(),
                _ => k.to_string(),
            };
            (k, v.to_string())
        })
        .collect()
}
