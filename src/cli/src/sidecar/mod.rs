//! `vramcap sidecar` and `vramcap top` (the preload side is src/preload/src/trace/sidecar.rs).
//! Protocol: docs/sidecar-protocol.md.

pub mod identity;
mod logline;
mod metrics;
mod reclaim;
mod server;
/// Public for the fuzz target `sidecar_records` (fuzz/), which feeds it client lines.
pub mod state;
pub mod top;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// docs/sidecar-protocol.md version (must match src/preload/src/trace/sidecar.rs `PROTOCOL`).
pub const PROTOCOL: u64 = 1;
/// The trace format the records follow (docs/trace-format.md).
pub const TRACE_VERSION: u64 = 1;

pub struct Options {
    pub socket: PathBuf,
    pub metrics: Option<String>,
    pub trace_dir: Option<PathBuf>,
    /// A connection that sends no complete first line within this time is dropped as bad.
    pub hello_timeout: Duration,
    /// Where the clients' group ledgers live (their `VRAMCAP_GROUP_DIR`); `None`: the members'
    /// default, one directory per uid (`/dev/shm/vramcap-<uid>`).
    pub group_dir: Option<PathBuf>,
    /// How often dead group members are reclaimed.
    pub reclaim_every: Duration,
    /// A connected client that sends nothing for this long is dropped.
    pub idle_timeout: Duration,
    /// Connections one uid may hold at once.
    pub max_per_uid: usize,
    /// Members of this group (and root) see every process in a query; others only their own uid's.
    pub admin_gid: Option<u32>,
}

/// Runs the sidecar until killed. `Err` is a message for the user (bad input, path owned).
pub fn run(opts: Options) -> Result<(), String> {
    if let Some(dir) = &opts.trace_dir {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create --trace-dir {}: {e}", dir.display()))?;
    }
    let metrics = match &opts.metrics {
        Some(addr) => {
            let l = std::net::TcpListener::bind(addr)
                .map_err(|e| format!("cannot listen for metrics on --metrics {addr}: {e}; expected HOST:PORT such as 127.0.0.1:9400"))?;
            Some(l)
        }
        None => None,
    };
    raise_fd_limit();
    let listener = listen(&opts.socket)?;
    eprintln!("vramcap: sidecar: listening on {}", opts.socket.display());
    let registry = Arc::new(Mutex::new(state::Registry::default()));
    if let Some(l) = metrics {
        let addr = l.local_addr().map_err(|e| e.to_string())?;
        eprintln!("vramcap: sidecar: metrics on http://{addr}/metrics");
        let r = registry.clone();
        std::thread::Builder::new().name("metrics".into()).spawn(move || metrics::serve(l, r)).map_err(|e| e.to_string())?;
    }
    reclaim::spawn(opts.group_dir.clone(), registry.clone(), opts.reclaim_every).map_err(|e| e.to_string())?;
    let limits = server::Limits {
        hello_timeout: opts.hello_timeout,
        idle_timeout: opts.idle_timeout,
        max_per_uid: opts.max_per_uid,
        admin_gid: opts.admin_gid,
    };
    server::Server::new(listener, registry, opts.trace_dir, limits).run();
    Ok(())
}

/// The sidecar holds up to 4 096 client connections plus the /metrics scrapers: the soft
/// descriptor limit (often 1 024) is raised to the hard one.
fn raise_fd_limit() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 && r.rlim_cur < r.rlim_max {
        r.rlim_cur = r.rlim_max.min(1 << 16);
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) };
    }
}

/// Binds the socket (mode 0660, its directory created if missing). A path where a live sidecar
/// answers is refused; a socket file nobody answers on (a killed sidecar) is taken over.
fn listen(path: &Path) -> Result<UnixListener, String> {
    let shown = path.display();
    // sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
    if path.as_os_str().len() >= 108 {
        return Err(format!("--socket {shown} is too long: a Unix socket path must be under 108 bytes"));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create the socket directory {}: {e}", dir.display()))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(format!("--socket {shown} exists and is not a socket; refusing to replace it"));
        }
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => return Err(format!("another sidecar is already listening on {shown}")),
            Err(_) => {
                std::fs::remove_file(path).map_err(|e| format!("cannot remove the stale socket {shown}: {e}"))?;
                eprintln!("vramcap: sidecar: took over the stale socket {shown}");
            }
        },
        Err(_) => {}
    }
    // The mask makes the socket 0660 from its creation (no window with wider permissions).
    let old = unsafe { libc::umask(0o117) };
    let bound = UnixListener::bind(path);
    unsafe { libc::umask(old) };
    let listener = bound.map_err(|e| format!("cannot listen on --socket {shown}: {e}"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| format!("cannot set mode 0660 on {shown}: {e}"))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    Ok(listener)
}
