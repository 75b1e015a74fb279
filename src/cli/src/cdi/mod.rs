//! `vramcap cdi`: a Container Device Interface spec that puts a container under a vramcap budget,
//! and `vramcap cdi-hook`, the hook the spec has the runtime run for each container
//! (docs/deploy.md, "Containers through CDI").
//!
//! One CDI device per budget (`vramcap.io/gpu=NAME`). Its edits mount, read-only:
//! - a host directory of the budget's own at `/etc/vramcap`, holding the ceiling file `limits`
//!   (the budget, the container's group and its ledger directory) and placeholders the other
//!   mounts land on;
//! - `libvramcap.so` at `/etc/vramcap/libvramcap.so` and `/etc/ld.so.preload` naming it, so every
//!   dynamically linked process of the container loads it whatever its environment;
//! - optionally the sidecar's socket directory at `/etc/vramcap/sidecar`.
//!
//! A static spec cannot name a per-container path, so its `createContainer` hook (run by the
//! runtime in the container's mount namespace, before the container's root is pivoted to) makes
//! the container's own ledger in a host directory and binds it over the placeholder, binds the
//! container's own trace directory, and binds the container's `/etc` onto itself (a read-only
//! root needs none): root in the container can rename a directory but not a mount point, so `/etc`, `/etc/vramcap`,
//! `/etc/ld.so.preload` and every file under `/etc/vramcap` then stay where the loader and the
//! library look for them. Its `poststop` hook removes the ledger.
//!
//! Everything lives under `/etc/vramcap` in the container on purpose: every directory from `/` to
//! each file is a mount point or read-only, so nothing can be moved out of the way without
//! `CAP_SYS_ADMIN` (which a default container lacks).

pub mod check;
pub mod document;
pub mod hook;
pub mod rootfs;
pub mod spec;

/// Where the budget's directory is mounted; the ceiling file is `limits` in it
/// (`vramcap_common::config::ceiling::PATH`).
pub const ETC_DIR: &str = "/etc/vramcap";
/// The library inside the container, as `/etc/ld.so.preload` names it.
pub const LIB_PATH: &str = "/etc/vramcap/libvramcap.so";
/// The group ledger's directory inside the container (`VRAMCAP_GROUP_DIR`).
pub const GROUP_DIR: &str = "/etc/vramcap/group";
/// The sidecar's socket directory inside the container.
pub const SIDECAR_DIR: &str = "/etc/vramcap/sidecar";
/// The container's trace directory inside the container.
pub const TRACE_DIR: &str = "/etc/vramcap/trace";
/// Each process's trace in it: executable, pid and start time, so an `exec` under the same pid
/// starts a new file.
pub const TRACE_TEMPLATE: &str = "%e-%p-%t.jsonl";
/// The first line of every file `vramcap cdi` writes: how it knows a file is its own to replace.
pub const MARKER: &str = "# Written by `vramcap cdi`";

/// Annotations that name a container's pod sandbox: containerd's CRI, then CRI-O's (which podman
/// also sets for the containers of a pod).
pub const SANDBOX_ANNOTATIONS: [&str; 2] = ["io.kubernetes.cri.sandbox-id", "io.kubernetes.cri-o.SandboxID"];

/// A container or sandbox id as a path component: runtimes use 64 hex digits; anything that could
/// leave the directory (`/`, `..`) or is absurdly long is refused.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-' | b'+'))
}
