//! The preload library links only what it may: its `[dependencies]` (and those of the one crate of
//! ours it depends on, vramcap-common) are the list, and the lock file's closure of them holds
//! nothing else. A crate added to either manifest, or one that brings a new crate with it, fails
//! here before it reaches every process of a container.

use std::collections::{BTreeMap, BTreeSet};
use vramcap_tests::common::root;

/// What DEVELOPERS.md allows the .so to depend on, plus our own shared crate.
const ALLOWED: &[&str] = &["libc", "libloading", "once_cell", "crossbeam-channel", "serde", "serde_json"];
/// What those bring with them (the lock file's closure); proc macros run at build time only.
const BROUGHT: &[&str] = &["serde_core", "serde_derive", "proc-macro2", "quote", "syn", "unicode-ident", "itoa", "memchr", "ryu", "zmij", "crossbeam-utils"];

/// The names in one `[section]` of a manifest (`name = ...` or `name.workspace = true`).
fn section(manifest: &str, name: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == format!("[{name}]");
            continue;
        }
        if inside && !line.is_empty() && !line.starts_with('#') {
            let key = line.split(['=', '.']).next().unwrap().trim();
            out.push(key.to_string());
        }
    }
    out
}

fn manifest(crate_dir: &str) -> String {
    std::fs::read_to_string(root().join(crate_dir).join("Cargo.toml")).unwrap()
}

/// The lock file as package name → the names it depends on.
fn lock_graph(lock: &str) -> BTreeMap<String, Vec<String>> {
    let mut graph = BTreeMap::new();
    for pkg in lock.split("[[package]]").skip(1) {
        let name = pkg.lines().find_map(|l| l.strip_prefix("name = ")).unwrap().trim_matches('"').to_string();
        let mut deps = Vec::new();
        if let Some(start) = pkg.find("dependencies = [") {
            let list = &pkg[start + "dependencies = [".len()..];
            let list = &list[..list.find(']').unwrap()];
            for d in list.split(',').map(|d| d.trim().trim_matches('"')).filter(|d| !d.is_empty()) {
                // "name" or "name version" when several versions are locked.
                deps.push(d.split(' ').next().unwrap().to_string());
            }
        }
        graph.insert(name, deps);
    }
    graph
}

fn closure(graph: &BTreeMap<String, Vec<String>>, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![from.to_string()];
    while let Some(p) = todo.pop() {
        for d in graph.get(&p).unwrap_or_else(|| panic!("{p} is not in Cargo.lock")) {
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    seen
}

#[test]
fn the_preload_library_depends_only_on_the_allowed_crates() {
    let preload = manifest("src/preload");
    let deps = section(&preload, "dependencies");
    for d in &deps {
        assert!(d == "vramcap-common" || ALLOWED.contains(&d.as_str()), "src/preload/Cargo.toml depends on {d}, which the .so may not link");
    }
    assert!(deps.contains(&"vramcap-common".to_string()) && deps.contains(&"libc".to_string()), "{deps:?}");
    let common = section(&manifest("src/common"), "dependencies");
    for d in &common {
        assert!(ALLOWED.contains(&d.as_str()), "src/common/Cargo.toml depends on {d}, which the .so (that links it) may not link");
    }
    for (dir, text) in [("src/preload", &preload), ("src/common", &manifest("src/common"))] {
        assert!(section(text, "build-dependencies").is_empty(), "{dir} has build dependencies");
    }
}

#[test]
fn nothing_else_reaches_the_preload_library_through_the_lock_file() {
    let graph = lock_graph(&std::fs::read_to_string(root().join("Cargo.lock")).unwrap());
    let all = closure(&graph, "vramcap-preload");
    let unexpected: Vec<&String> = all.iter().filter(|p| *p != "vramcap-common" && !ALLOWED.contains(&p.as_str()) && !BROUGHT.contains(&p.as_str())).collect();
    assert!(unexpected.is_empty(), "the preload library now pulls in {unexpected:?} (all: {all:?})");
    // The CLI's crates are not among them (they would be, were the CLI linked in).
    for cli in ["clap", "plotters", "indicatif"] {
        assert!(!all.contains(cli), "{cli} reaches the preload library");
        assert!(closure(&graph, "vramcap-cli").contains(cli), "the check would not see {cli}: it is no longer the CLI's either");
    }
}

#[test]
fn the_manifest_reader_sees_an_added_dependency() {
    let m = "[package]\nname = \"x\"\n[dependencies]\nlibc.workspace = true\n# a comment\nclap = \"4\"\n[dev-dependencies]\nfoo = \"1\"\n";
    assert_eq!(section(m, "dependencies"), ["libc", "clap"]);
    let lock = "[[package]]\nname = \"a\"\ndependencies = [\n \"b\",\n \"c 1.0.0\",\n]\n\n[[package]]\nname = \"b\"\n\n[[package]]\nname = \"c\"\ndependencies = [\"d\"]\n\n[[package]]\nname = \"d\"\n";
    assert_eq!(closure(&lock_graph(lock), "a").into_iter().collect::<Vec<_>>(), ["b", "c", "d"]);
}
