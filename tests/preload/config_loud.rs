//! Misconfiguration is loud (issue 15): a misspelled `VRAMCAP_*` name, in any case, is named once
//! on stderr with the nearest known name; a value of blanks only is unset and says so.

use vramcap_tests::common;
use common::*;

#[test]
fn misspelled_variables_are_named_once_with_the_nearest_known_name() {
    let out = Run::client("client_procaddr")
        .env("VRAMCAP_LIMITS", "256m")
        .env("VRAMCAP_LIMITX", "256m")
        .env("vramcap_limit", "256m")
        .args(["init ctx 0 alloc 512m info alloc 1m"])
        .run();
    out.ok();
    for bad in ["VRAMCAP_LIMITS", "VRAMCAP_LIMITX", "vramcap_limit"] {
        let line = format!("ignoring unknown variable {bad}: did you mean VRAMCAP_LIMIT?");
        assert_eq!(out.stderr.matches(&line).count(), 1, "{bad} once: {}", out.stderr);
    }
    // They are ignored, as the lines say: no cap.
    assert_eq!(out.nth("alloc", 0).rc(), 0);
}

#[test]
fn a_value_of_blanks_only_is_unset_and_says_so() {
    let out = Run::client("client_linked")
        .env("VRAMCAP_LIMIT", "   ")
        .env("VRAMCAP_TRACE", "\t")
        .args(["init ctx 0 alloc 1m"])
        .run();
    out.ok();
    assert_eq!(out.nth("alloc", 0).rc(), 0);
    for v in ["VRAMCAP_LIMIT", "VRAMCAP_TRACE"] {
        let line = format!("{v} is set to blanks only");
        assert_eq!(out.stderr.matches(&line).count(), 1, "{v}: {}", out.stderr);
    }
    assert!(out.stderr.contains("treated as unset"));
}
