//! Finding the trace files a job wrote from its `VRAMCAP_TRACE` template: one file, or one per
//! process with `%p` (`%t`, `%e`, `%h` too), plus `PATH.<pid>` files that forked children write
//! when the template has no `%p` (src/preload/src/trace/mod.rs decides those names).

use std::path::{Path, PathBuf};
use std::time::SystemTime;

#[derive(Debug, PartialEq)]
enum Tok {
    Lit(char),
    /// `%p`, `%t`: one or more digits.
    Digits,
    /// `%e`, `%h`: one or more characters.
    Any,
}

fn tokens(name: &str) -> Vec<Tok> {
    let mut out = Vec::new();
    let mut it = name.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(Tok::Lit(c));
            continue;
        }
        match it.next() {
            Some('p' | 't') => out.push(Tok::Digits),
            Some('e' | 'h') => out.push(Tok::Any),
            Some('%') => out.push(Tok::Lit('%')),
            // The writer keeps an unknown placeholder as written.
            Some(o) => {
                out.push(Tok::Lit('%'));
                out.push(Tok::Lit(o));
            }
            None => out.push(Tok::Lit('%')),
        }
    }
    out
}

fn matches(t: &[Tok], s: &[char]) -> bool {
    match t.first() {
        None => s.is_empty(),
        Some(Tok::Lit(c)) => s.first() == Some(c) && matches(&t[1..], &s[1..]),
        Some(Tok::Digits) => {
            (1..=s.len()).take_while(|&n| s[n - 1].is_ascii_digit()).any(|n| matches(&t[1..], &s[n..]))
        }
        Some(Tok::Any) => (1..=s.len()).any(|n| matches(&t[1..], &s[n..])),
    }
}

/// Does the file name `name` come from the template's file name `tmpl` (or a forked child's
/// `<name>.<pid>`)?
pub fn name_matches(tmpl: &str, name: &str) -> bool {
    let s: Vec<char> = name.chars().collect();
    let mut t = tokens(tmpl);
    if matches(&t, &s) {
        return true;
    }
    t.push(Tok::Lit('.'));
    t.push(Tok::Digits);
    matches(&t, &s)
}

/// The trace files written for `template` and modified at or after `since`, sorted by name. Only
/// files owned by the user asking: a trace directory may be shared (`/tmp`), and another user's
/// file, with any header it likes, is never this user's job.
pub fn find(template: &str, since: SystemTime) -> Result<Vec<PathBuf>, String> {
    let path = Path::new(template);
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let Some(file) = path.file_name().and_then(|f| f.to_str()) else {
        return Err(format!("trace path {template:?} has no file name"));
    };
    if dir.to_string_lossy().contains('%') {
        return Err(format!(
            "trace path {template:?}: placeholders are only looked up in the file name, not in directories"
        ));
    }
    let rd = std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    // A little slack: file times may be coarser than the clock we compare them with.
    let since = since.checked_sub(std::time::Duration::from_secs(2)).unwrap_or(since);
    let mut out: Vec<PathBuf> = rd
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_str().is_some_and(|n| name_matches(file, n)))
        .filter(|e| {
            use std::os::unix::fs::MetadataExt;
            let me = unsafe { libc::geteuid() };
            e.metadata().ok().is_some_and(|m| m.uid() == me && m.modified().is_ok_and(|t| t >= since))
        })
        .map(|e| e.path())
        .collect();
    out.sort();
    Ok(out)
}

/// The trace files named in `list` (`VRAMCAP_TRACE_LIST`: each of the job's processes appends
/// the path it opened, as a JSON string per line): those that are regular files of this user.
/// The list lies in a directory only we can enter, so every line is a process of the job's; a
/// line that is no JSON string (a process killed mid-write) is skipped.
pub fn listed(list: &Path) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let me = unsafe { libc::geteuid() };
    let text = std::fs::read_to_string(list).unwrap_or_default();
    let mut out: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<String>(l).ok())
        .map(PathBuf::from)
        .filter(|p| p.is_absolute() && std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.uid() == me))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Both lists, each file once, sorted.
pub fn union(mut a: Vec<PathBuf>, b: Vec<PathBuf>) -> Vec<PathBuf> {
    a.extend(b);
    a.sort();
    a.dedup();
    a
}

/// What a trace's header (its first line) says about who wrote it.
struct Ids {
    pid: u32,
    ppid: u32,
    job: Option<String>,
    /// `start_unix_ns`: when the process started tracing (absent in a header without it).
    start: Option<u64>,
}

fn header_ids(path: &Path) -> Option<Ids> {
    use std::io::Read;
    /// Only the fields we need; the rest (a `cmdline` of any length) is skipped as it is read, so
    /// a long header costs no memory and a huge one only reading time.
    #[derive(serde::Deserialize)]
    struct Head {
        #[serde(rename = "type")]
        kind: Option<serde_json::Value>,
        pid: Option<serde_json::Value>,
        ppid: Option<serde_json::Value>,
        job: Option<serde_json::Value>,
        start_unix_ns: Option<serde_json::Value>,
    }
    let f = std::fs::File::open(path).ok()?;
    let mut de = serde_json::Deserializer::from_reader(std::io::BufReader::new(f.take(1 << 30)));
    let v: Head = serde::Deserialize::deserialize(&mut de).ok()?;
    (v.kind?.as_str()? == "header").then_some(())?;
    Some(Ids {
        pid: u32::try_from(v.pid?.as_u64()?).ok()?,
        ppid: u32::try_from(v.ppid?.as_u64()?).ok()?,
        job: v.job.as_ref().and_then(|j| j.as_str()).map(str::to_string),
        start: v.start_unix_ns.and_then(|t| t.as_u64()),
    })
}

/// Of `files`, those this job wrote: every trace whose header carries the job's id (`job`, the
/// `VRAMCAP_JOB` that `vramcap run` gave it; this finds processes behind a shell or `make` that
/// wrote no trace, and children that daemonized), and those written by `root` and its
/// descendants by the pid and parent pid in their headers (a process that lost the id: a program
/// that cleared its environment). Another job writing to the same template at the same time has
/// another id and is not a descendant. A trace whose process started before `since` (the job's
/// start) is no process of this job, whatever its id: an earlier step run under the same launcher
/// id, a pid the job's tree reused.
pub fn of_tree(files: Vec<PathBuf>, root: u32, job: Option<&str>, since: SystemTime) -> Vec<PathBuf> {
    let since_ns = since.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let ids: Vec<Option<Ids>> =
        files.iter().map(|f| header_ids(f).filter(|i| i.start.is_none_or(|t| t >= since_ns))).collect();
    let ours = |i: &Ids| job.is_some() && i.job.as_deref() == job;
    let mut tree = std::collections::BTreeSet::from([root]);
    tree.extend(ids.iter().flatten().filter(|i| ours(i)).map(|i| i.pid));
    // Parents appear before children in no particular file order: grow to a fixed point.
    loop {
        let before = tree.len();
        for i in ids.iter().flatten() {
            // A trace with another job's id is that job's, whoever its parent was.
            if tree.contains(&i.ppid) && (i.job.is_none() || ours(i)) {
                tree.insert(i.pid);
            }
        }
        if tree.len() == before {
            break;
        }
    }
    files
        .into_iter()
        .zip(ids)
        .filter(|(_, id)| id.as_ref().is_some_and(|i| ours(i) || (tree.contains(&i.pid) && (i.job.is_none() || ours(i)))))
        .map(|(f, _)| f)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes one header per `(pid, ppid, job, start_unix_ns)` and returns the file names
    /// `of_tree` keeps for `root`, `job` and a run that started at 1000 ns.
    fn kept(test: &str, headers: &[(u32, u32, Option<&str>, Option<u64>)], root: u32, job: Option<&str>) -> Vec<String> {
        let d = std::env::temp_dir().join(format!("vramcap-traces-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let mut files = Vec::new();
        for &(pid, ppid, job, start) in headers {
            let f = d.join(format!("t-{pid}.jsonl"));
            let job = job.map(|j| format!(",\"job\":\"{j}\"")).unwrap_or_default();
            let start = start.map(|t| format!(",\"start_unix_ns\":{t}")).unwrap_or_default();
            std::fs::write(&f, format!("{{\"type\":\"header\",\"version\":1,\"pid\":{pid},\"ppid\":{ppid}{job}{start}}}\n")).unwrap();
            files.push(f);
        }
        let since = SystemTime::UNIX_EPOCH + std::time::Duration::from_nanos(1000);
        let mut out: Vec<String> = of_tree(files, root, job, since).iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
        out.sort();
        std::fs::remove_dir_all(&d).unwrap();
        out
    }

    #[test]
    fn of_tree_keeps_the_job_and_its_descendants_only() {
        // 300 is a grandchild listed before its parent 200; 900 belongs to another job.
        let h = [(300, 200, None, None), (100, 50, None, None), (200, 100, None, None), (900, 1, None, None), (901, 900, None, None)];
        assert_eq!(kept("tree", &h, 100, None), ["t-100.jsonl", "t-200.jsonl", "t-300.jsonl"]);
    }

    #[test]
    fn of_tree_keeps_every_trace_with_the_jobs_id() {
        // 400: the job's, behind a shell (pid 350) that wrote no trace; 500: daemonized (ppid 1);
        // 600: its child, without the id (its environment was cleared); 700: a child of the
        // job's root carrying another job's id; 900: another job; 800: the job's id, but its
        // process started before this run (an earlier run under the same id).
        let h = [
            (400, 350, Some("J"), Some(2000)),
            (500, 1, Some("J"), None),
            (600, 500, None, None),
            (700, 100, Some("K"), None),
            (900, 1, Some("K"), None),
            (800, 1, Some("J"), Some(999)),
        ];
        assert_eq!(kept("job", &h, 100, Some("J")), ["t-400.jsonl", "t-500.jsonl", "t-600.jsonl"]);
    }

    #[test]
    fn find_leaves_out_another_users_files() {
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: needs root (to make a file another user owns)");
            return;
        }
        let d = std::env::temp_dir().join(format!("vramcap-traces-owner-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        for n in ["r-1.jsonl", "r-2.jsonl"] {
            std::fs::write(d.join(n), "").unwrap();
        }
        let c = std::ffi::CString::new(d.join("r-2.jsonl").to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
        let t = d.join("r-%p.jsonl").to_string_lossy().into_owned();
        let got = find(&t, SystemTime::now() - std::time::Duration::from_secs(60)).unwrap();
        assert_eq!(got, vec![d.join("r-1.jsonl")], "another user's file is not this user's job");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn placeholders_match_what_the_writer_expands() {
        assert!(name_matches("t.jsonl", "t.jsonl"));
        assert!(name_matches("t.jsonl", "t.jsonl.4242"), "forked child without %p");
        assert!(!name_matches("t.jsonl", "t.jsonl.x"));
        assert!(!name_matches("t.jsonl", "u.jsonl"));
        assert!(name_matches("job-%p.jsonl", "job-17.jsonl"));
        assert!(!name_matches("job-%p.jsonl", "job-.jsonl"));
        assert!(!name_matches("job-%p.jsonl", "job-1a.jsonl"));
        assert!(name_matches("%h-%e-%p.jsonl", "node-7-python3-12.jsonl"));
        assert!(name_matches("%t_%p", "1764441600_99"));
        assert!(name_matches("100%%-%p", "100%-5"));
        assert!(!name_matches("100%%-%p", "100%%-5"));
    }

    #[test]
    fn find_lists_fresh_matches_only() {
        let d = std::env::temp_dir().join(format!("vramcap-traces-find-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        for n in ["r-1.jsonl", "r-22.jsonl", "other.jsonl"] {
            std::fs::write(d.join(n), "").unwrap();
        }
        let t = d.join("r-%p.jsonl").to_string_lossy().into_owned();
        let got = find(&t, SystemTime::now() - std::time::Duration::from_secs(60)).unwrap();
        assert_eq!(got, vec![d.join("r-1.jsonl"), d.join("r-22.jsonl")]);
        let later = find(&t, SystemTime::now() + std::time::Duration::from_secs(3600)).unwrap();
        assert!(later.is_empty(), "files older than the run are not this run's");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
