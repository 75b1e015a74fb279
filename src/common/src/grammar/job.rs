//! The form of a job id (`VRAMCAP_JOB`), in one place: the library checks it before writing it
//! into a trace header, and `vramcap run` checks a value it finds in the environment before the
//! job starts. An id names the job a process belongs to across processes that write no trace of
//! their own (a shell, `make`) and across daemonized children, which the parent pids in headers
//! cannot follow.

/// What a usable id looks like, for error messages.
pub const FORM: &str = "1 to 128 characters from A-Z a-z 0-9 . _ : -";

/// The id itself, trimmed, or why not.
pub fn parse(v: &str) -> Result<&str, String> {
    let t = v.trim();
    if t.is_empty() {
        return Err("it is empty".into());
    }
    if t.len() > 128 {
        return Err(format!("it is {} characters long", t.len()));
    }
    match t.chars().find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-'))) {
        Some(c) => Err(format!("it contains {c:?}")),
        None => Ok(t),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_plain_tokens() {
        assert_eq!(super::parse(" 0f3a-job_7:retry.2 "), Ok("0f3a-job_7:retry.2"));
        assert_eq!(super::parse(&"a".repeat(128)).map(str::len), Ok(128));
        for bad in ["", "  ", "a b", "a\"b", "a\nb", "é", "x/y", &"a".repeat(129)] {
            assert!(super::parse(bad).is_err(), "{bad:?}");
        }
    }
}
