//! What the integration test binaries share: running the built library and binary under a clean
//! environment on the fake driver ([`common`]), the CLI ([`cli_support`]), a sidecar
//! ([`sidecar_support`]) and trace files ([`trace_support`]).

pub mod cli_support;
pub mod common;
pub mod observe_support;
pub mod sidecar_support;
pub mod trace_support;

/// The fuzz targets' decoding of an input into environment variables (tests/cli/fuzz_regressions.rs
/// replays their findings through it).
#[path = "../../fuzz/src/env_input.rs"]
pub mod env_input;
