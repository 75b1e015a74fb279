//! The group ledger's layout/validation and file handling, by path.
#[path = "../../src/group/shm.rs"]
pub mod shm;
#[path = "../../src/group/file.rs"]
pub mod file;
#[path = "../../src/group/liveness.rs"]
pub mod liveness;
#[path = "../../src/group/guard.rs"]
pub mod guard;
