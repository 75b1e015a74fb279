//! What a process tells the node's sidecar about itself beyond its memory (docs/security.md):
//! its command line only when `VRAMCAP_SIDECAR_CMDLINE=1`, and then with the values of
//! arguments that look like secrets replaced by `***`. The sidecar applies the same redaction to
//! whatever a client sends, so an older or hostile client cannot make it store a secret either.

/// Argument names whose values are secrets (matched case-insensitively, anywhere in the name).
const SECRET_WORDS: [&str; 4] = ["key", "token", "secret", "password"];
/// What replaces a secret value.
pub const MASK: &str = "***";
/// At most this many bytes of arguments are kept; the rest is summarised.
const MAX_BYTES: usize = 4096;
/// Each argument is cut to this many characters.
const MAX_ARG_CHARS: usize = 256;

/// `VRAMCAP_SIDECAR_CMDLINE`: only an explicit yes sends the command line; anything else
/// (unset, `0`, a typo) keeps it private.
pub fn cmdline_wanted(value: Option<&str>) -> bool {
    matches!(value.map(|v| v.trim().to_ascii_lowercase()).as_deref(), Some("1" | "true" | "yes" | "on"))
}

fn secret_name(name: &str) -> bool {
    let n = name.trim_start_matches('-').to_ascii_lowercase();
    !n.is_empty() && SECRET_WORDS.iter().any(|w| n.contains(w))
}

/// `scheme://user:password@host/...` keeps everything but the user information.
fn without_url_credentials(a: &str) -> Option<String> {
    let (scheme, rest) = a.split_once("://")?;
    let end = rest.find('/').unwrap_or(rest.len());
    let at = rest[..end].rfind('@')?;
    Some(format!("{scheme}://{MASK}@{}", &rest[at + 1..]))
}

/// The command line as it may be shown: `--api-key=X` → `--api-key=***`, `--token X` →
/// `--token ***`, `DB_PASSWORD=X` → `DB_PASSWORD=***`, credentials in URLs masked; long
/// arguments cut, and at most 4 KiB in all.
pub fn redact(args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut bytes = 0;
    let mut next_is_secret = false;
    for (i, a) in args.iter().enumerate() {
        let shown = if next_is_secret {
            next_is_secret = false;
            MASK.to_string()
        } else if let Some((name, _)) = a.split_once('=').filter(|(n, _)| secret_name(n)) {
            format!("{name}={MASK}")
        } else if let Some(url) = without_url_credentials(a) {
            url
        } else {
            next_is_secret = i > 0 && a.starts_with('-') && secret_name(a);
            a.clone()
        };
        let shown: String = if shown.chars().count() > MAX_ARG_CHARS {
            shown.chars().take(MAX_ARG_CHARS).chain("...".chars()).collect()
        } else {
            shown
        };
        if bytes + shown.len() > MAX_BYTES {
            out.push(format!("...({} more arguments)", args.len() - i));
            break;
        }
        bytes += shown.len();
        out.push(shown);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(args: &[&str]) -> Vec<String> {
        redact(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn secret_values_are_masked_and_the_rest_kept() {
        assert_eq!(
            r(&["python3", "train.py", "--api-key=sk-123", "--epochs", "3", "--token", "abc", "HF_TOKEN=hf_x", "--Password=p"]),
            ["python3", "train.py", "--api-key=***", "--epochs", "3", "--token", "***", "HF_TOKEN=***", "--Password=***"]
        );
        assert_eq!(r(&["x", "--secret-file", "/run/s", "--lr=0.1"]), ["x", "--secret-file", "***", "--lr=0.1"]);
        assert_eq!(r(&["git", "clone", "https://u:pw@example.com/r.git"]), ["git", "clone", "https://***@example.com/r.git"]);
        // The program's own name is never taken for a flag.
        assert_eq!(r(&["--key-tool", "arg"]), ["--key-tool", "arg"]);
    }

    #[test]
    fn long_command_lines_are_bounded() {
        let many: Vec<String> = (0..10_000).map(|i| format!("arg{i}")).collect();
        let out = redact(&many);
        assert!(out.iter().map(String::len).sum::<usize>() < MAX_BYTES + 64);
        assert!(out.last().unwrap().contains("more arguments"));
        let long = r(&["x", &"a".repeat(10_000)]);
        assert_eq!(long[1].len(), MAX_ARG_CHARS + 3);
    }

    #[test]
    fn only_an_explicit_yes_sends_the_command_line() {
        for v in ["1", "true", " YES ", "on"] {
            assert!(cmdline_wanted(Some(v)), "{v}");
        }
        for v in [None, Some(""), Some("0"), Some("no"), Some("maybe")] {
            assert!(!cmdline_wanted(v), "{v:?}");
        }
    }
}
