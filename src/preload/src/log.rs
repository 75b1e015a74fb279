//! stderr messages. Never on the allocation fast path: only configuration problems, start-up
//! information and (rate-limited) denials (`denials`) print. Writes go straight to fd 2 with one
//! `write` per line so lines from several threads or processes do not interleave.

use std::sync::atomic::{AtomicU8, Ordering};
pub use vramcap_common::config::Level;

pub fn write_line(line: &str) {
    let mut buf = Vec::with_capacity(line.len() + 1);
    buf.extend_from_slice(line.as_bytes());
    buf.push(b'\n');
    let _ = write_all(2, &buf);
}

/// Writes everything, retrying short writes and EINTR (stderr here, the trace file in
/// `trace::writer`). On error: how many bytes were written, and the error.
pub fn write_all(fd: i32, bytes: &[u8]) -> Result<(), (usize, std::io::Error)> {
    let mut off = 0;
    while off < bytes.len() {
        let n = unsafe { libc::write(fd, bytes[off..].as_ptr().cast(), bytes.len() - off) };
        if n > 0 {
            off += n as usize;
            continue;
        }
        let err = std::io::Error::last_os_error();
        if n < 0 && err.kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        return Err((off, err));
    }
    Ok(())
}

/// `VRAMCAP_LOG`, as the configuration set it when it was read (`warn` until then).
static LEVEL: AtomicU8 = AtomicU8::new(Level::Warn as u8);

/// Called once the configuration is read.
pub fn set_level(level: Level) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

pub fn enabled(level: Level) -> bool {
    level as u8 <= LEVEL.load(Ordering::Relaxed)
}

macro_rules! log_at {
    ($level:expr, $($arg:tt)*) => {
        if $crate::log::enabled($level) {
            $crate::log::write_line(&format!("vramcap: {}", format_args!($($arg)*)));
        }
    };
}
pub(crate) use log_at;

pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

