//! `vramcap cdi`: checks every input, then writes each budget's directory (its ceiling file and
//! mount points) and the CDI spec naming them. Bad input writes nothing.

use super::document::{Node, list, map, s};
use super::{ETC_DIR, GROUP_DIR, LIB_PATH, MARKER, SIDECAR_DIR, TRACE_DIR, TRACE_TEMPLATE, check};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use vramcap_common::grammar::limits::parse_list;
use vramcap_common::grammar::size::Size;

#[derive(clap::Args, Debug)]
pub struct CdiArgs {
    /// A budget, NAME=SPEC (repeatable): the CDI device KIND=NAME, whose container's processes
    /// share SPEC (VRAMCAP_LIMIT's grammar: 20GiB, 50%, 0=20GiB,1=10GiB) as one group.
    #[arg(long = "device", value_name = "NAME=SPEC", required = true)]
    pub devices: Vec<String>,
    /// The library to inject (default: libvramcap.so next to this binary).
    #[arg(long, value_name = "PATH")]
    pub lib: Option<PathBuf>,
    /// Write the spec here, in /etc/cdi or /var/run/cdi (.yaml or .yml: YAML, .json: JSON);
    /// default: YAML on stdout.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Host directory under which the hook makes each container's (or pod's) ledger directory
    /// (best on a tmpfs: a reboot then leaves nothing behind).
    #[arg(long, value_name = "DIR", default_value = "/run/vramcap-ledgers")]
    pub group_dir: PathBuf,
    /// The node sidecar's socket (vramcap sidecar --socket): its directory is mounted read-only
    /// into each container and the processes stream to it.
    #[arg(long, value_name = "PATH")]
    pub sidecar: Option<PathBuf>,
    /// Host directory under which each container's processes write their traces, one directory
    /// per container (DIR/<container id>/).
    #[arg(long, value_name = "DIR")]
    pub trace_dir: Option<PathBuf>,
    /// The CDI kind: devices are named KIND=NAME.
    #[arg(long, default_value = "vramcap.io/gpu")]
    pub kind: String,
    /// Where the budgets' directories (each mounted at /etc/vramcap) are kept.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/vramcap/cdi")]
    pub state_dir: PathBuf,
    /// The vramcap binary the runtime runs as the hook (default: this one).
    #[arg(long, value_name = "PATH")]
    pub hook: Option<PathBuf>,
}

/// One budget as given.
#[derive(Debug, Clone)]
pub struct Budget {
    pub name: String,
    pub spec: String,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Format {
    Yaml,
    Json,
}

/// Everything checked, absolute, ready to write.
#[derive(Debug)]
pub struct Plan {
    budgets: Vec<Budget>,
    lib: PathBuf,
    hook: PathBuf,
    kind: String,
    /// `state_dir/<kind as a file name>`.
    state: PathBuf,
    group_dir: PathBuf,
    sidecar: Option<PathBuf>,
    trace_dir: Option<PathBuf>,
    out: Option<(PathBuf, Format)>,
}

fn budget(arg: &str) -> Result<Budget, String> {
    let Some((name, spec)) = arg.split_once('=') else {
        return Err(format!("--device {arg:?}: no `=`; expected NAME=SPEC such as small=8GiB or a100=0=20GiB,1=20GiB"));
    };
    check::device_name(name).map_err(|e| format!("--device {arg:?}: {e}"))?;
    let entries = parse_list(&format!("--device {name}"), spec).map_err(|e| {
        format!("--device {arg:?}: `{}`: {}; expected NAME=SPEC with SPEC {}", e.value, e.reason, e.expected)
    })?;
    if entries.iter().any(|e| e.size == Size::Unlimited) {
        return Err(format!(
            "--device {arg:?}: 0 means no limit, and a budget without a limit caps nothing; expected a size such as 8GiB or 50%"
        ));
    }
    Ok(Budget { name: name.to_string(), spec: spec.trim().to_string() })
}

fn format_of(out: &Path) -> Result<Format, String> {
    match out.extension().and_then(|e| e.to_str()) {
        Some("json") => Ok(Format::Json),
        Some("yaml" | "yml") => Ok(Format::Yaml),
        _ => Err(format!(
            "--out {}: runtimes read only *.json, *.yaml and *.yml in their CDI directories; expected one of those extensions",
            out.display()
        )),
    }
}

/// Whether `text` is a spec this command wrote: YAML starts with the marker; JSON (which cannot
/// hold a comment) is ours when every device runs our hook.
pub fn is_ours(text: &str) -> bool {
    if text.starts_with(MARKER) {
        return true;
    }
    let Ok(v) = serde_json::from_str::<serde_json::Value>(text) else { return false };
    let Some(devices) = v.get("devices").and_then(|d| d.as_array()).filter(|d| !d.is_empty()) else { return false };
    devices.iter().all(|d| {
        d.pointer("/containerEdits/hooks").and_then(|h| h.as_array()).is_some_and(|hooks| {
            hooks.iter().any(|h| h.get("args").and_then(|a| a.get(1)).and_then(|a| a.as_str()) == Some("cdi-hook"))
        })
    })
}

/// Checks every input; nothing is written until all pass.
pub fn plan(a: &CdiArgs) -> Result<Plan, String> {
    if unsafe { libc::geteuid() } != 0 {
        return Err("must run as root: the ceiling file in each budget's directory counts inside a container only when \
                    root owns it and its directory (docs/configuration.md)"
            .into());
    }
    let mut budgets: Vec<Budget> = Vec::new();
    for d in &a.devices {
        let b = budget(d)?;
        if budgets.iter().any(|o| o.name == b.name) {
            return Err(format!("--device {}: the name {:?} is given twice; expected one budget per name", d, b.name));
        }
        budgets.push(b);
    }
    check::kind(&a.kind)?;
    let lib = match &a.lib {
        Some(l) => l.clone(),
        None => crate::cli::preload_library()?,
    };
    let lib = std::fs::canonicalize(&lib).map_err(|e| format!("--lib {}: {e}; expected the path of libvramcap.so", lib.display()))?;
    check::elf_shared_object(&lib)?;
    let hook = match &a.hook {
        Some(h) => h.clone(),
        None => std::env::current_exe().map_err(|e| format!("cannot find this binary's own path for the hook: {e}; give --hook"))?,
    };
    let hook = std::fs::canonicalize(&hook).map_err(|e| format!("--hook {}: {e}; expected the vramcap binary", hook.display()))?;
    let hm = std::fs::metadata(&hook).map_err(|e| format!("--hook {}: {e}", hook.display()))?;
    if !hm.is_file() || hm.mode() & 0o100 == 0 {
        return Err(format!("--hook {}: not an executable file; expected the vramcap binary", hook.display()));
    }
    check::root_owned("--hook", &hook, &hm)?;
    for (flag, p) in [("--group-dir", Some(&a.group_dir)), ("--state-dir", Some(&a.state_dir)), ("--sidecar", a.sidecar.as_ref()), ("--trace-dir", a.trace_dir.as_ref())] {
        if let Some(p) = p {
            check::absolute(flag, p)?;
        }
    }
    if let Some(sock) = &a.sidecar {
        let dir = sock.parent().filter(|d| d.is_dir()).ok_or_else(|| {
            format!("--sidecar {}: its directory does not exist; expected the socket path of a sidecar (vramcap sidecar --socket), whose directory each container mounts", sock.display())
        })?;
        let shared = std::fs::metadata(dir).map_or(true, |m| m.mode() & 0o002 != 0);
        if sock.file_name().is_none() || dir == Path::new("/") || shared {
            // Each container sees the whole directory: /tmp would show them every user's files.
            return Err(format!(
                "--sidecar {}: expected a socket in a directory of its own that only its owner can write, such as /run/vramcap/sidecar.sock",
                sock.display()
            ));
        }
    }
    // Every container sees the sidecar's directory: nothing of other containers may be in it.
    if let Some(dir) = a.sidecar.as_ref().and_then(|s| s.parent()) {
        for (flag, p) in [("--group-dir", Some(&a.group_dir)), ("--state-dir", Some(&a.state_dir)), ("--trace-dir", a.trace_dir.as_ref())] {
            if let Some(p) = p
                && (p.starts_with(dir) || dir.starts_with(p))
            {
                return Err(format!(
                    "{flag} {} and --sidecar's directory {} overlap: every container sees the sidecar's directory, so it \
                     would see other containers' files; expected directories apart",
                    p.display(),
                    dir.display()
                ));
            }
        }
    }
    let out = match &a.out {
        None => None,
        Some(o) => {
            let f = format_of(o)?;
            if let Some(dir) = o.parent().filter(|d| !d.as_os_str().is_empty())
                && !dir.is_dir()
            {
                return Err(format!("--out {}: directory {} does not exist", o.display(), dir.display()));
            }
            match std::fs::symlink_metadata(o) {
                Ok(m) if !m.is_file() => return Err(format!("--out {}: exists and is not a regular file; left alone", o.display())),
                Ok(_) => {
                    let text = std::fs::read_to_string(o).map_err(|e| format!("--out {}: {e}", o.display()))?;
                    if !is_ours(&text) {
                        return Err(format!(
                            "--out {}: exists and is not a spec vramcap cdi wrote; left alone (remove it, or choose another file)",
                            o.display()
                        ));
                    }
                }
                Err(_) => {}
            }
            Some((o.clone(), f))
        }
    };
    let state = a.state_dir.join(a.kind.replace('/', "_"));
    for b in &budgets {
        check_own_dir(&state.join(&b.name))?;
    }
    Ok(Plan {
        budgets,
        lib,
        hook,
        kind: a.kind.clone(),
        state,
        group_dir: a.group_dir.clone(),
        sidecar: a.sidecar.clone(),
        trace_dir: a.trace_dir.clone(),
        out,
    })
}

/// A budget directory that exists must be one we made: a root-owned real directory nobody else
/// can write, whose `limits` (if any) carries our marker.
fn check_own_dir(dir: &Path) -> Result<(), String> {
    let Ok(m) = std::fs::symlink_metadata(dir) else { return Ok(()) };
    if !m.is_dir() || m.uid() != 0 || m.mode() & 0o022 != 0 {
        return Err(format!("{}: exists and is not a directory only root can write; left alone", dir.display()));
    }
    match std::fs::read_to_string(dir.join("limits")) {
        Ok(t) if !t.starts_with(MARKER) => {
            Err(format!("{}/limits: exists and was not written by vramcap cdi; left alone", dir.display()))
        }
        _ => Ok(()),
    }
}

impl Plan {
    fn budget_dir(&self, b: &Budget) -> PathBuf {
        self.state.join(&b.name)
    }

    /// The ceiling file's variables, also set as the container's environment (what the library
    /// reads where the ceiling file cannot count, e.g. under a user namespace).
    fn variables(&self, b: &Budget) -> Vec<(String, String)> {
        let mut v = vec![
            ("VRAMCAP_GROUP".to_string(), b.name.clone()),
            ("VRAMCAP_GROUP_DIR".to_string(), GROUP_DIR.to_string()),
            ("VRAMCAP_GROUP_LIMIT".to_string(), b.spec.clone()),
            // No one process above the budget, even if the ledger were rewritten.
            ("VRAMCAP_LIMIT".to_string(), b.spec.clone()),
        ];
        if let Some(sock) = &self.sidecar {
            let name = sock.file_name().unwrap_or_default().to_string_lossy();
            v.push(("VRAMCAP_SIDECAR".into(), format!("{SIDECAR_DIR}/{name}")));
        }
        if self.trace_dir.is_some() {
            v.push(("VRAMCAP_TRACE".into(), format!("{TRACE_DIR}/{TRACE_TEMPLATE}")));
        }
        v
    }

    fn limits_text(&self, b: &Budget) -> String {
        let mut t = format!(
            "{MARKER} for the CDI device {}={}: this container's ceiling\n\
             # (docs/configuration.md). Regenerate it with vramcap cdi rather than editing it.\n",
            self.kind, b.name
        );
        for (k, v) in self.variables(b) {
            t.push_str(&format!("{k}={v}\n"));
        }
        t
    }

    fn device(&self, b: &Budget) -> Node {
        let ro = || list([s("ro"), s("nosuid"), s("nodev"), s("bind")]);
        let mount = |host: &Path, ctr: &str| map([("hostPath", s(host.to_string_lossy())), ("containerPath", s(ctr)), ("options", ro())]);
        let mut mounts = vec![
            mount(&self.budget_dir(b), ETC_DIR),
            mount(&self.lib, LIB_PATH),
            mount(&self.state.join("ld.so.preload"), "/etc/ld.so.preload"),
        ];
        if let Some(dir) = self.sidecar.as_ref().and_then(|s| s.parent()) {
            mounts.push(mount(dir, SIDECAR_DIR));
        }
        let hook = self.hook.to_string_lossy().into_owned();
        let mut create = vec!["vramcap", "cdi-hook", "create-container", "--device", &b.name].into_iter().map(s).collect::<Vec<_>>();
        create.extend([s("--budget-dir"), s(self.budget_dir(b).to_string_lossy()), s("--group-dir"), s(self.group_dir.to_string_lossy())]);
        if let Some(t) = &self.trace_dir {
            create.extend([s("--trace-dir"), s(t.to_string_lossy())]);
        }
        let poststop = vec![s("vramcap"), s("cdi-hook"), s("poststop"), s("--device"), s(&b.name), s("--group-dir"), s(self.group_dir.to_string_lossy())];
        map([
            ("name", s(&b.name)),
            (
                "containerEdits",
                map([
                    ("env", list(self.variables(b).into_iter().map(|(k, v)| s(format!("{k}={v}"))))),
                    ("mounts", list(mounts)),
                    (
                        "hooks",
                        list([
                            map([("hookName", s("createContainer")), ("path", s(&hook)), ("args", list(create)), ("timeout", Node::Int(30))]),
                            map([("hookName", s("poststop")), ("path", s(&hook)), ("args", list(poststop)), ("timeout", Node::Int(30))]),
                        ]),
                    ),
                ]),
            ),
        ])
    }

    /// The lowest `cdiVersion` that has every feature used: 0.3.0, or 0.5.0 when a device name
    /// starts with a digit (earlier versions required a letter).
    pub fn cdi_version(&self) -> &'static str {
        if self.budgets.iter().any(|b| b.name.as_bytes()[0].is_ascii_digit()) { "0.5.0" } else { "0.3.0" }
    }

    pub fn spec(&self) -> Node {
        map([
            ("cdiVersion", s(self.cdi_version())),
            ("kind", s(&self.kind)),
            ("devices", list(self.budgets.iter().map(|b| self.device(b)))),
        ])
    }

    fn header(&self) -> String {
        format!(
            "{MARKER} (vramcap {}): one CDI device per budget, {}=NAME.\n\
             # Regenerate it with vramcap cdi rather than editing it (docs/deploy.md).\n",
            env!("CARGO_PKG_VERSION"),
            self.kind
        )
    }

    fn text(&self, format: Format) -> String {
        match format {
            Format::Yaml => self.spec().to_yaml(&self.header()),
            Format::Json => self.spec().to_json(),
        }
    }

    /// Writes the budgets' directories, then the spec (to `--out` or stdout).
    pub fn write(&self) -> Result<(), String> {
        make_dir(&self.state)?;
        write_file(&self.state.join("ld.so.preload"), &format!("{LIB_PATH}\n"), 0o444)?;
        for b in &self.budgets {
            let dir = self.budget_dir(b);
            make_dir(&dir)?;
            for sub in ["group", "sidecar", "trace"] {
                make_dir(&dir.join(sub))?;
            }
            placeholder(&dir.join("libvramcap.so"))?;
            placeholder(&dir.join("group").join(format!("vramcap-group-{}", b.name)))?;
            write_file(&dir.join("limits"), &self.limits_text(b), 0o444)?;
        }
        match &self.out {
            Some((p, f)) => write_file(p, &self.text(*f), 0o644),
            None => {
                use std::io::Write;
                std::io::stdout().write_all(self.text(Format::Yaml).as_bytes()).map_err(|e| format!("cannot write to stdout: {e}"))
            }
        }
    }
}

/// A root-owned directory nobody else can write (made if missing, parents included).
fn make_dir(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let m = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !m.is_dir() || m.uid() != 0 {
        return Err(format!("{}: not a directory of root's; left alone", dir.display()));
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).map_err(|e| format!("cannot chmod {}: {e}", dir.display()))
}

/// An empty file a mount lands on (left as it is if there).
fn placeholder(p: &Path) -> Result<(), String> {
    match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o444).custom_flags(libc::O_NOFOLLOW).open(p) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => match std::fs::symlink_metadata(p) {
            Ok(m) if m.is_file() => Ok(()),
            _ => Err(format!("{}: exists and is not a regular file; left alone", p.display())),
        },
        Err(e) => Err(format!("cannot create {}: {e}", p.display())),
    }
}

/// Replaces `p` at once (a temporary file renamed over it): a container starting meanwhile sees
/// the old file or the new one, never half of one.
fn write_file(p: &Path, text: &str, mode: u32) -> Result<(), String> {
    let tmp = p.with_file_name(format!(".{}.{}.tmp", p.file_name().unwrap_or_default().to_string_lossy(), std::process::id()));
    let res = (|| {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).custom_flags(libc::O_NOFOLLOW).open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.sync_all()?;
        std::fs::rename(&tmp, p)
    })();
    res.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write {}: {e}", p.display())
    })
}

pub fn main(a: CdiArgs) -> Result<(), String> {
    plan(&a)?.write()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_with_the_limit_grammar() {
        let b = budget("small=8GiB").unwrap();
        assert_eq!((b.name.as_str(), b.spec.as_str()), ("small", "8GiB"));
        assert_eq!(budget("a100=0=20g,1=10g").unwrap().spec, "0=20g,1=10g");
        for (bad, says) in [
            ("small", "no `=`"),
            ("small=lots", "`lots`"),
            ("small=8", "has no unit"),
            ("small=0", "0 means no limit"),
            ("-x=1g", "not usable"),
            ("a=0=1g,0=2g", "named twice"),
        ] {
            let e = budget(bad).unwrap_err();
            assert!(e.contains(says) && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn only_our_own_specs_are_replaced() {
        assert!(is_ours(&format!("{MARKER} (vramcap 0.1.0)\ncdiVersion: \"0.3.0\"\n")));
        assert!(is_ours(r#"{"devices":[{"name":"a","containerEdits":{"hooks":[{"args":["vramcap","cdi-hook","create-container"]}]}}]}"#));
        assert!(!is_ours("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n"));
        assert!(!is_ours(r#"{"cdiVersion":"0.5.0","kind":"nvidia.com/gpu","devices":[{"name":"0","containerEdits":{}}]}"#));
        assert!(!is_ours(r#"{"devices":[]}"#));
    }
}
