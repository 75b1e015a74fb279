//! The form of a group name, in one place: members check `VRAMCAP_GROUP` with it
//! (`group::from_vars`) and the sidecar checks the names clients send with it (a name becomes a
//! file name under the group directory, so `/` and a leading `.` never pass).

/// What a usable name looks like, for error messages.
pub const FORM: &str = "1 to 64 characters from A-Z a-z 0-9 . _ - (not starting with .)";

/// True for a name a member accepts as `VRAMCAP_GROUP`.
pub fn valid(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 64
        && !v.starts_with('.')
        && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_never_leave_the_directory() {
        for bad in ["", "..", "../x", "a/b", ".hidden", "x y", "a\0b", &"n".repeat(65), "é"] {
            assert!(!super::valid(bad), "{bad:?}");
        }
        for good in ["team", "hami-0123456789abcdef", "a.b_c-d", &"n".repeat(64)] {
            assert!(super::valid(good), "{good:?}");
        }
    }
}
