//! What the fuzz targets reach, from the crates that define it (nothing here is a copy): the
//! configuration, grammar, group ledger and trace records of `vramcap-common`, and the analysis
//! commands and the sidecar's record decoder of `vramcap-cli`.

pub use vramcap_cli::{analysis, sidecar};
pub use vramcap_common::config;
pub use vramcap_common::grammar::{limits, size};
pub use vramcap_common::group_ledger as group;

pub mod env_input;

/// A per-process scratch directory for targets that must go through files.
pub fn scratch_dir() -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("vramcap-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("scratch dir");
        d
    })
    .clone()
}
