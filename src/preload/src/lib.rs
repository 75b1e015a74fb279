//! libvramcap.so: an `LD_PRELOAD` library in front of the CUDA driver that caps device memory per
//! process and device, traces every counted call and streams it to the node's sidecar. See
//! docs/architecture.md for how the pieces fit. What the `vramcap` command shares with it (the
//! limit grammar and configuration, the group ledger and its sharing rules, the trace records)
//! is the `vramcap-common` crate's.
//!
//! The modules come in layers; each uses only its own layer and those below (checked by
//! `tests::modules_only_reach_down`):
//!
//! 1. **What calls the driver**: [`hooks`] (the one declarative table of wrapped entry points),
//!    [`dl`] (our `dlsym` trampoline and the driver handle we open), [`intercept`] (the wrappers).
//! 2. **Bookkeeping**: [`ledger`] and [`livetable`] (per-device budgets, live allocations),
//!    [`group`] (this process as a member of a group budget), [`events`] and [`trace`] (records
//!    of every call, the writer thread, the sidecar stream), [`denials`] (the denial lines),
//!    [`ceiling_watch`] (limits changed while the process runs: the ceiling file, the group's),
//!    [`observe`] (observe mode: what the cap would have refused, granted and recorded).
//! 3. **Configuration**: [`config`] (the environment and the ceiling file, read at start).
//! 4. **Plumbing**: [`ffi`] (driver types), [`sync`] (a fork-safe lock), [`clock`], [`log`].

// 1. What calls the driver.
pub mod dl;
pub mod hooks;
pub mod intercept;
// 2. Bookkeeping.
pub mod ceiling_watch;
pub mod denials;
pub mod events;
pub mod group;
pub mod ledger;
pub mod livetable;
pub mod observe;
pub mod trace;
// 3. Configuration.
pub mod config;
// 4. Plumbing.
pub mod clock;
pub mod ffi;
pub mod log;
pub mod sync;

#[cfg(test)]
mod tests {
    /// Each module's layer (the list above). A module may name (`crate::x`) only modules of its
    /// own layer or below: configuration never starts the trace writer, the event path never
    /// reaches into the hook table, plumbing knows nothing of budgets.
    const LAYERS: &[(&str, u8)] = &[
        ("dl", 1),
        ("hooks", 1),
        ("intercept", 1),
        ("ceiling_watch", 2),
        ("denials", 2),
        ("events", 2),
        ("group", 2),
        ("ledger", 2),
        ("livetable", 2),
        ("observe", 2),
        ("trace", 2),
        ("config", 3),
        ("clock", 4),
        ("ffi", 4),
        ("log", 4),
        ("sync", 4),
    ];

    fn layer(m: &str) -> u8 {
        LAYERS.iter().find(|(n, _)| *n == m).unwrap_or_else(|| panic!("module {m} has no layer in lib.rs's list")).1
    }

    fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                sources(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    /// Every `crate::<module>` a module's files name, with the line.
    fn references(text: &str) -> Vec<(String, usize)> {
        let mut out = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for (i, _) in code.match_indices("crate::") {
                // `$crate::log::...` in a macro is the log module too.
                let name: String = code[i + 7..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                if !name.is_empty() {
                    out.push((name, n + 1));
                }
            }
        }
        out
    }

    #[test]
    fn modules_only_reach_down() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        sources(&root, &mut files);
        let mut bad = Vec::new();
        for f in &files {
            let rel = f.strip_prefix(&root).unwrap();
            let module = rel.iter().next().unwrap().to_string_lossy().trim_end_matches(".rs").to_string();
            if module == "lib" {
                continue;
            }
            let mine = layer(&module);
            for (used, line) in references(&std::fs::read_to_string(f).unwrap()) {
                if used != module && layer(&used) < mine {
                    bad.push(format!("{}:{line}: {module} (layer {mine}) uses crate::{used} (layer {})", rel.display(), layer(&used)));
                }
            }
        }
        assert!(files.len() > 30, "only {} source files found", files.len());
        assert!(bad.is_empty(), "modules reaching up a layer:\n{}", bad.join("\n"));
    }

    #[test]
    fn the_layer_check_can_fail() {
        let refs = references("use crate::hooks::HOOKS; // crate::ledger in a comment\n$crate::log::write_line(x)");
        assert_eq!(refs, [("hooks".to_string(), 1), ("log".to_string(), 2)]);
        assert!(layer("hooks") < layer("events"), "events naming hooks would be reported");
    }
}
