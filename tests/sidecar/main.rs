//! The sidecar: its protocol, metrics, top, and hostile clients.

mod sidecar;
mod sidecar_hostile;
