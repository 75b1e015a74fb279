//! Would the process `vramcap run` is about to start get the preload library? The loader skips
//! `LD_PRELOAD` silently (or with one line the job's log buries) in cases a user cannot see
//! coming, and the job then runs uncapped: a statically linked program (no loader runs at all), a
//! set-user-ID, set-group-ID or file-capability program (secure-execution mode ignores preload
//! paths with a slash), a library the user cannot read. `doctor` checks the environment's own
//! `LD_PRELOAD` by loading it in a child (`--probe preloaded`), which also covers a bare name that
//! does not resolve.

use std::ffi::{CString, OsStr};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// `prog` as `execvp` finds it: a name with a slash as it is, else the first executable file of
/// that name on `PATH`.
pub fn resolve(prog: &OsStr) -> Option<PathBuf> {
    if prog.as_bytes().contains(&b'/') {
        return Some(PathBuf::from(prog));
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&path).map(|d| d.join(prog)).find(|p| executable(p))
}

fn executable(p: &Path) -> bool {
    let Ok(c) = CString::new(p.as_os_str().as_bytes()) else { return false };
    p.is_file() && unsafe { libc::access(c.as_ptr(), libc::X_OK) } == 0
}

/// Whether this user can read `p` (what the loader needs to map a preload library).
pub fn readable(p: &Path) -> bool {
    let Ok(c) = CString::new(p.as_os_str().as_bytes()) else { return false };
    (unsafe { libc::access(c.as_ptr(), libc::R_OK) }) == 0
}

/// ELF's PT_INTERP program header: present in every dynamically linked program.
const PT_INTERP: u32 = 3;

/// `Some(true)`: an ELF program with an interpreter (the dynamic loader); `Some(false)`: an ELF
/// program without one (statically linked, static-pie included); `None`: not an ELF file or not
/// readable here (nothing is claimed).
fn has_interpreter(head: &[u8], file: &mut std::fs::File) -> Option<bool> {
    use std::io::{Seek, SeekFrom};
    if head.len() < 64 || &head[..4] != b"\x7fELF" {
        return None;
    }
    let wide = match head[4] {
        1 => false,
        2 => true,
        _ => return None,
    };
    let le = match head[5] {
        1 => true,
        2 => false,
        _ => return None,
    };
    let u16_at = |b: &[u8], o: usize| if le { u16::from_le_bytes([b[o], b[o + 1]]) } else { u16::from_be_bytes([b[o], b[o + 1]]) };
    let u32_at = |b: &[u8], o: usize| {
        let a = [b[o], b[o + 1], b[o + 2], b[o + 3]];
        if le { u32::from_le_bytes(a) } else { u32::from_be_bytes(a) }
    };
    let u64_at = |b: &[u8], o: usize| {
        let a: [u8; 8] = b[o..o + 8].try_into().unwrap();
        if le { u64::from_le_bytes(a) } else { u64::from_be_bytes(a) }
    };
    let (phoff, phentsize, phnum) =
        if wide { (u64_at(head, 32), u16_at(head, 54), u16_at(head, 56)) } else { (u32_at(head, 28) as u64, u16_at(head, 42), u16_at(head, 44)) };
    let entsize = phentsize as usize;
    if entsize < 4 || phnum == 0 || phnum > 4096 {
        return None;
    }
    let mut table = vec![0u8; entsize * phnum as usize];
    file.seek(SeekFrom::Start(phoff)).ok()?;
    file.read_exact(&mut table).ok()?;
    Some(table.chunks(entsize).any(|ph| u32_at(ph, 0) == PT_INTERP))
}

/// What the loader will do with `LD_PRELOAD` in a process started from `prog` (the file `exec`
/// runs: a script's interpreter is followed): one sentence per reason it would not preload.
pub fn program_warnings(prog: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut path = prog.to_path_buf();
    // A script: its interpreter is what the loader starts (`#!/usr/bin/env python3` goes on to
    // python3 on PATH). A few levels at most.
    for _ in 0..4 {
        let Ok(mut f) = std::fs::File::open(&path) else { return out };
        let mut head = vec![0u8; 256];
        let n = f.read(&mut head).unwrap_or(0);
        head.truncate(n);
        let shown = path.display().to_string();
        if let Some(meta) = f.metadata().ok().filter(|m| m.is_file()) {
            let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
            let mode = meta.mode();
            if mode & libc::S_ISUID != 0 && meta.uid() != uid {
                out.push(format!("{shown} is set-user-ID (owner uid {}): the loader ignores LD_PRELOAD paths in such a process (secure-execution mode), so it runs uncapped", meta.uid()));
            } else if mode & libc::S_ISGID != 0 && meta.gid() != gid {
                out.push(format!("{shown} is set-group-ID (group {}): the loader ignores LD_PRELOAD paths in such a process (secure-execution mode), so it runs uncapped", meta.gid()));
            } else if has_file_capabilities(&path) {
                out.push(format!("{shown} has file capabilities: the loader ignores LD_PRELOAD paths in such a process (secure-execution mode), so it runs uncapped"));
            }
        }
        if let Some(rest) = head.strip_prefix(b"#!") {
            let line = rest.split(|&b| b == b'\n').next().unwrap_or(&[]);
            let mut words = line.split(|b| b.is_ascii_whitespace()).filter(|w| !w.is_empty());
            let Some(interp) = words.next() else { return out };
            let interp = Path::new(OsStr::from_bytes(interp));
            path = if interp.file_name() == Some(OsStr::new("env")) {
                match words.find(|w| !w.starts_with(b"-")).and_then(|w| resolve(OsStr::from_bytes(w))) {
                    Some(p) => p,
                    None => return out,
                }
            } else {
                interp.to_path_buf()
            };
            continue;
        }
        if has_interpreter(&head, &mut f) == Some(false) {
            out.push(format!(
                "{shown} is statically linked: no dynamic loader runs in it to read LD_PRELOAD, so it runs uncapped (programs it starts that are dynamically linked still get vramcap)"
            ));
        }
        return out;
    }
    out
}

fn has_file_capabilities(p: &Path) -> bool {
    let Ok(c) = CString::new(p.as_os_str().as_bytes()) else { return false };
    let name = c"security.capability";
    unsafe { libc::getxattr(c.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) > 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dynamic_program_has_an_interpreter_and_a_script_follows_to_it() {
        let sh = resolve(OsStr::new("sh")).expect("sh on PATH");
        assert!(program_warnings(&sh).is_empty(), "{:?}", program_warnings(&sh));
        let mut f = std::fs::File::open(std::env::current_exe().unwrap()).unwrap();
        let mut head = vec![0u8; 256];
        let n = f.read(&mut head).unwrap();
        assert_eq!(has_interpreter(&head[..n], &mut f), Some(true));
        assert_eq!(has_interpreter(b"#!/bin/sh\n", &mut f), None);
        assert!(resolve(OsStr::new("no-such-program-anywhere")).is_none());
    }
}
