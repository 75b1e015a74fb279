//! Containers for real: `vramcap cdi`'s spec in podman with runc (issue 27). The CLI's checks
//! (cdi_cli), the cap inside a container and what root inside cannot do to it (cap), budgets
//! per container and per pod, and a killed container's budget (budgets), the trace directory and
//! the sidecar's view of containers (observe), and a HAMi-core setup with vramcap in libvgpu.so's
//! place (hami). Harness: podman.rs.

mod budgets;
mod cap;
mod cdi_cli;
mod hami;
mod observe;
mod podman;
