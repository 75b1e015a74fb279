//! The sidecar: its protocol, metrics, top, hostile clients, and the container and pod of each client.

mod sidecar;
mod sidecar_hostile;
mod sidecar_identity;
mod sidecar_load;
mod sidecar_observe;
