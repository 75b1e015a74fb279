//! The variable names vramcap reads, and the lines that make a misconfiguration loud: a
//! misspelled `VRAMCAP_*` name (any case: `VRAMCAP_LIMITS`, `VRAMCAP_LIMITX`, `vramcap_limit`)
//! would otherwise run the job uncapped without a word, and a value of blanks only is unset.

/// Every `VRAMCAP_*` variable (docs/configuration.md); `VRAMCAP_LIMIT_<i>` and
/// `VRAMCAP_GROUP_LIMIT_<i>` are the per-device families (their suffix is checked by the limit
/// parser, which names a bad one).
pub const KNOWN: &[&str] = &[
    "VRAMCAP_DISABLE",
    "VRAMCAP_LOG",
    "VRAMCAP_MODE",
    "VRAMCAP_LIMIT",
    "VRAMCAP_GROUP",
    "VRAMCAP_GROUP_LIMIT",
    "VRAMCAP_GROUP_DIR",
    "VRAMCAP_GROUP_POLICY",
    "VRAMCAP_GROUP_RESERVE",
    "VRAMCAP_GROUP_HEADROOM",
    "VRAMCAP_PRIORITY",
    "VRAMCAP_REAL_LIBCUDA",
    "VRAMCAP_REAL_LIBNVML",
    "VRAMCAP_TRACE",
    "VRAMCAP_TRACE_MODE",
    "VRAMCAP_TRACE_LIST",
    "VRAMCAP_JOB",
    "VRAMCAP_SIDECAR",
    "VRAMCAP_SIDECAR_CMDLINE",
    "VRAMCAP_TEST_PANIC",
];

const FAMILIES: &[&str] = &["VRAMCAP_LIMIT_", "VRAMCAP_GROUP_LIMIT_", "VRAMCAP_GROUP_RESERVE_", "VRAMCAP_GROUP_HEADROOM_"];

pub fn is_known(name: &str) -> bool {
    KNOWN.contains(&name) || FAMILIES.iter().any(|f| name.starts_with(f) && name.len() > f.len())
}

/// Whether a name is ours to check: `VRAMCAP_` in any case.
pub fn is_ours(name: &str) -> bool {
    name.len() >= 8 && name[..8].eq_ignore_ascii_case("VRAMCAP_")
}

/// Edit distance (insertions, deletions, substitutions), on ASCII upper case.
fn distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.to_ascii_uppercase().into_bytes(), b.as_bytes());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, &ca) in a.iter().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb)).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The known name nearest to `name`.
pub fn nearest(name: &str) -> &'static str {
    let upper = name.to_ascii_uppercase();
    // `vramcap_limit_0` is the family member of its upper-case form.
    if let Some(f) = FAMILIES.iter().find(|f| upper.starts_with(**f) && upper.len() > f.len()) {
        return &f[..f.len() - 1];
    }
    KNOWN.iter().min_by_key(|k| distance(&upper, k)).copied().unwrap_or("VRAMCAP_LIMIT")
}

/// One warning per unknown `VRAMCAP_*` name and per known variable set to blanks only.
pub fn warnings<'a>(vars: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<String> {
    let mut out = Vec::new();
    for (k, v) in vars {
        if is_ours(k) && !is_known(k) {
            let near = nearest(k);
            let case = if k.eq_ignore_ascii_case(near) || is_known(&k.to_ascii_uppercase()) {
                " (names are upper case)"
            } else {
                ""
            };
            out.push(format!(
                "ignoring unknown variable {k}: did you mean {near}?{case} Known variables are listed in docs/configuration.md"
            ));
        } else if (is_known(k) || k.starts_with("CUDA_DEVICE_MEMORY_LIMIT")) && !v.is_empty() && v.trim().is_empty() {
            out.push(format!("{k} is set to blanks only ({v:?}): treated as unset"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every variable configuration.md documents is one the library knows, so none of them draws
    /// the "unknown variable" warning (a variable added to the docs but not to KNOWN would).
    #[test]
    fn every_documented_variable_is_known() {
        let doc = include_str!("../../../../docs/configuration.md");
        let mut seen = 0;
        for (i, _) in doc.match_indices("`VRAMCAP_") {
            let name: String = doc[i + 1..].chars().take_while(|c| c.is_ascii_uppercase() || *c == '_' || c.is_ascii_digit()).collect();
            let name = name.trim_end_matches('_');
            if name == "VRAMCAP" {
                continue; // the `VRAMCAP_*` pattern itself
            }
            // `VRAMCAP_LIMIT_<i>` is written with its family's prefix, or with an index.
            if FAMILIES.iter().any(|f| f.trim_end_matches('_') == name) || is_known(name) {
                seen += 1;
                continue;
            }
            panic!("docs/configuration.md documents {name}, which names.rs does not know");
        }
        assert!(seen >= KNOWN.len(), "only {seen} mentions found");
        for k in KNOWN {
            assert!(doc.contains(&format!("`{k}")), "{k} is known but not documented");
        }
    }

    fn w(vars: &[(&str, &str)]) -> Vec<String> {
        warnings(vars.iter().map(|(a, b)| (*a, *b)))
    }

    #[test]
    fn misspelled_names_suggest_the_nearest() {
        for (bad, near) in [
            ("VRAMCAP_LIMITS", "VRAMCAP_LIMIT"),
            ("VRAMCAP_LIMITX", "VRAMCAP_LIMIT"),
            ("vramcap_limit", "VRAMCAP_LIMIT"),
            ("Vramcap_Group_Dir", "VRAMCAP_GROUP_DIR"),
            ("VRAMCAP_GRUOP", "VRAMCAP_GROUP"),
            ("VRAMCAP_TRACES", "VRAMCAP_TRACE"),
            ("vramcap_limit_1", "VRAMCAP_LIMIT"),
            ("VRAMCAP_DISABLED", "VRAMCAP_DISABLE"),
        ] {
            let got = w(&[(bad, "8g")]);
            assert_eq!(got.len(), 1, "{bad}: {got:?}");
            assert!(got[0].contains(&format!("unknown variable {bad}: did you mean {near}?")), "{got:?}");
        }
        assert!(w(&[("vramcap_limit", "1")])[0].contains("upper case"));
        assert!(!w(&[("VRAMCAP_LIMITS", "1")])[0].contains("upper case"));
    }

    #[test]
    fn known_names_and_other_programs_variables_are_quiet() {
        let ok = [
            ("VRAMCAP_LIMIT", "8g"),
            ("VRAMCAP_LIMIT_3", "1g"),
            ("VRAMCAP_GROUP_LIMIT_0", "1g"),
            ("VRAMCAP_TRACE", ""),
            ("PATH", " "),
            ("VRAMCAPX", "1"),
            ("CUDA_VISIBLE_DEVICES", "0"),
        ];
        assert_eq!(w(&ok), Vec::<String>::new());
        // The family's bare prefix is not a name.
        assert_eq!(w(&[("VRAMCAP_LIMIT_", "1g")]).len(), 1);
    }

    #[test]
    fn blanks_only_is_unset_and_says_so() {
        let got = w(&[("VRAMCAP_LIMIT", "  "), ("VRAMCAP_GROUP", "\t"), ("CUDA_DEVICE_MEMORY_LIMIT", " ")]);
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(got[0].contains("VRAMCAP_LIMIT is set to blanks only") && got[0].contains("treated as unset"));
    }
}
