//! What the exported-memory tests share: a private group directory, the fake device file the
//! test's processes share (`FAKECUDA_SHARED_DEVICE`, `SharedDevice`), the unix sockets fds are
//! passed on, and a FIFO the test opens to say "go" to a waiting process.

use vramcap_tests::common::*;
use std::path::{Path, PathBuf};

/// Every exported-memory test holds this for reading; a test whose import keeps every id byte (an
/// import of a fd that names no allocation: it keeps every group's ended exports on the machine,
/// by design) holds it for writing, so it never runs beside a test that expects one back.
static MACHINE: std::sync::RwLock<()> = std::sync::RwLock::new(());

#[allow(dead_code)]
enum Hold {
    Shared(std::sync::RwLockReadGuard<'static, ()>),
    Alone(std::sync::RwLockWriteGuard<'static, ()>),
}

thread_local! {
    /// This thread's hold and how many of its scenes use it: a test that makes a second scene
    /// (its bare run, then its run with vramcap) must not ask the lock again (a waiting writer
    /// would block its second read for good).
    static HELD: std::cell::RefCell<(u32, Option<Hold>)> = const { std::cell::RefCell::new((0, None)) };
}

pub struct Scene {
    pub dir: PathBuf,
    pub devfile: PathBuf,
    pub sock: PathBuf,
    pub sock2: PathBuf,
    /// A FIFO (`waitfifo` waits on it, [`go`] opens it).
    pub go1: PathBuf,
}

pub fn scene() -> Scene {
    make(false)
}

/// A scene no other exported-memory test runs beside (see [`MACHINE`]).
pub fn scene_alone() -> Scene {
    make(true)
}

fn make(alone: bool) -> Scene {
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        if h.0 == 0 {
            h.1 = Some(if alone {
                Hold::Alone(MACHINE.write().unwrap_or_else(|e| e.into_inner()))
            } else {
                Hold::Shared(MACHINE.read().unwrap_or_else(|e| e.into_inner()))
            });
        }
        h.0 += 1;
    });
    let dir = private_group_dir();
    let go1 = fifo(&dir, "go1");
    Scene { devfile: dir.join("device"), sock: dir.join("sock"), sock2: dir.join("sock2"), go1, dir }
}

impl Drop for Scene {
    fn drop(&mut self) {
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            h.0 -= 1;
            if h.0 == 0 {
                h.1 = None;
            }
        });
    }
}

/// One more FIFO in `dir`.
pub fn fifo(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    assert!(std::process::Command::new("mkfifo").arg(&p).status().unwrap().success(), "mkfifo {}", p.display());
    p
}

/// Says go to whoever waits on `fifo`.
pub fn go(fifo: &Path) {
    drop(std::fs::OpenOptions::new().write(true).open(fifo).unwrap());
}

/// `r` on the scene's shared fake device.
pub fn on_device(s: &Scene, r: Run) -> Run {
    r.env("FAKECUDA_SHARED_DEVICE", &s.devfile)
}

/// `r` as a member of group `name` (256 MiB, the scene's directory), on its device.
pub fn in_group(s: &Scene, name: &str, r: Run) -> Run {
    on_device(s, r).env("VRAMCAP_GROUP", name).env("VRAMCAP_GROUP_DIR", &s.dir).env("VRAMCAP_GROUP_LIMIT", "256m")
}
