//! What `vramcap cdi` checks before it writes anything: names, the kind, the library, the hook
//! binary and the paths. Each error names the flag, what was given and what is expected.

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// A budget's name: a CDI device name (`vramcap.io/gpu=NAME`) that is also a group name
/// (`VRAMCAP_GROUP`) and a file name, so the same word names it everywhere.
pub const NAME_FORM: &str = "1 to 64 characters from A-Z a-z 0-9 . _ -, starting and ending with a letter or digit";

pub fn device_name(name: &str) -> Result<(), String> {
    let b = name.as_bytes();
    let edge = |c: Option<&u8>| c.is_some_and(u8::is_ascii_alphanumeric);
    let ok = !b.is_empty()
        && b.len() <= 64
        && edge(b.first())
        && edge(b.last())
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'));
    if ok { Ok(()) } else { Err(format!("device name {name:?} is not usable; expected {NAME_FORM}")) }
}

/// `vendor/class` as CDI defines them: the vendor a domain-like name (letters, digits, `.`, `_`,
/// `-`), the class a word (letters, digits, `_`, `-`; a dot in it needs cdiVersion 0.6.0, which
/// podman 4.3 cannot read, so it is refused).
pub fn kind(kind: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("--kind {kind:?}: {why}; expected VENDOR/CLASS such as vramcap.io/gpu"));
    let Some((vendor, class)) = kind.split_once('/') else { return bad("no `/`") };
    let word = |w: &str, extra: &[u8]| {
        let b = w.as_bytes();
        !b.is_empty()
            && b[0].is_ascii_alphabetic()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter().all(|c| c.is_ascii_alphanumeric() || extra.contains(c))
    };
    if !word(vendor, b"._-") {
        return bad("the vendor must start with a letter, end with a letter or digit and hold only letters, digits, `.`, `_`, `-`");
    }
    if !word(class, b"_-") {
        return bad("the class must start with a letter, end with a letter or digit and hold only letters, digits, `_`, `-`");
    }
    Ok(())
}

pub fn absolute(flag: &str, p: &Path) -> Result<(), String> {
    if p.is_absolute() && !p.components().any(|c| matches!(c, std::path::Component::ParentDir)) {
        Ok(())
    } else {
        Err(format!("{flag} {:?}: expected an absolute path without `..` (runtimes resolve it on the host, from anywhere)", p.display()))
    }
}

/// A file injected into every container, or run as root by the runtime for each one: whoever can
/// write it runs code in all of them. Root's, and writable by nobody else.
pub fn root_owned(flag: &str, p: &Path, m: &std::fs::Metadata) -> Result<(), String> {
    if m.uid() != 0 || m.mode() & 0o022 != 0 {
        return Err(format!(
            "{flag} {}: owned by uid {} with mode {:o}; expected a file of root's that only root can write \
             (it runs in, or for, every container the spec starts)",
            p.display(),
            m.uid(),
            m.mode() & 0o7777
        ));
    }
    Ok(())
}

/// `e_machine` of the machine this binary was built for: the library must match it.
fn host_machine() -> Option<u16> {
    match std::env::consts::ARCH {
        "x86_64" => Some(62),
        "aarch64" => Some(183),
        _ => None,
    }
}

/// An ELF shared library of this machine's architecture: 64-bit, little-endian, `ET_DYN`, and no
/// `PT_INTERP` (a position-independent program is `ET_DYN` too, but has an interpreter).
pub fn elf_shared_object(p: &Path) -> Result<(), String> {
    let shown = p.display();
    let m = std::fs::metadata(p).map_err(|e| format!("--lib {shown}: {e}; expected the path of libvramcap.so"))?;
    if !m.is_file() {
        return Err(format!("--lib {shown}: not a regular file; expected the path of libvramcap.so"));
    }
    root_owned("--lib", p, &m)?;
    let mut f = std::fs::File::open(p).map_err(|e| format!("--lib {shown}: {e}"))?;
    let mut head = Vec::new();
    f.by_ref().take(64 * 1024).read_to_end(&mut head).map_err(|e| format!("--lib {shown}: {e}"))?;
    let not = |why: &str| Err(format!("--lib {shown}: {why}; expected an ELF shared object (libvramcap.so)"));
    if head.len() < 64 || &head[..4] != b"\x7fELF" {
        return not("not an ELF file");
    }
    if head[4] != 2 || head[5] != 1 {
        return not("not a 64-bit little-endian ELF file");
    }
    let u16_at = |o: usize| u16::from_le_bytes([head[o], head[o + 1]]);
    let u64_at = |o: usize| u64::from_le_bytes(head[o..o + 8].try_into().unwrap());
    if u16_at(16) != 3 {
        return not("an ELF file that is not a shared object (e_type is not ET_DYN)");
    }
    if let Some(want) = host_machine()
        && u16_at(18) != want
    {
        return not(&format!("built for another architecture (e_machine {}, this machine's is {want})", u16_at(18)));
    }
    let (phoff, phentsize, phnum) = (u64_at(32) as usize, u16_at(54) as usize, u16_at(56) as usize);
    for i in 0..phnum {
        let o = phoff + i * phentsize;
        if o + 4 > head.len() || phentsize < 4 {
            return not("program headers out of reach");
        }
        if u32::from_le_bytes(head[o..o + 4].try_into().unwrap()) == 3 {
            return not("a program (it has an interpreter), not a library");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_cdi_device_names_and_group_names() {
        for good in ["small", "a100-20g", "20g", "x", "a.b_c-d9"] {
            device_name(good).unwrap();
            assert!(vramcap_common::grammar::group_name::valid(good));
        }
        for bad in ["", "-a", "a-", ".a", "a:b", "a/b", "a b", "é", &"n".repeat(65)] {
            assert!(device_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn kinds() {
        kind("vramcap.io/gpu").unwrap();
        kind("example.com/gpu-budget").unwrap();
        for bad in ["gpu", "vramcap.io/", "/gpu", "vramcap.io/g.pu", "1x.io/gpu", "vramcap.io/gpu/x", "vramcap.io/gpu-"] {
            assert!(kind(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_program_is_not_a_library() {
        // This test binary is a position-independent program: ET_DYN with an interpreter.
        let me = std::env::current_exe().unwrap();
        let e = elf_shared_object(&me).unwrap_err();
        assert!(e.contains("not a library") || e.contains("owned by uid"), "{e}");
        let e = elf_shared_object(Path::new("/definitely/missing.so")).unwrap_err();
        assert!(e.contains("No such file"), "{e}");
    }
}
