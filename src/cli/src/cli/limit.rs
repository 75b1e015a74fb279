//! `vramcap limit --group NAME [--group-dir DIR] [--enforce] [--drop-exports] [SPEC]`: print or
//! change a running group's budget in its ledger (issue 26), turn an observing group to enforce,
//! or give back exported memory of ended members that the group cannot decide about (issue 23). Members judge every allocation against the ledger's limit
//! word, so a change applies to the next allocation of each; members joining later adopt it
//! (`group_ledger::budget`).
//!
//! Only the uid that owns the ledger file, or root, may change it: a ledger that is
//! group-writable (the default mode lets the group's users join) grants its Unix group nothing
//! here. The check is on the file this command mapped, not on a path looked up again.

use vramcap_common::config::ceiling;
use vramcap_common::grammar::group::default_dir;
use vramcap_common::grammar::group_name;
use vramcap_common::grammar::limits::{DeviceKey, parse_list};
use vramcap_common::grammar::size::{Size, human};
use vramcap_common::group_ledger::shm::{self, Shared, SlotWord, State};
use vramcap_common::group_ledger::{file, reclaim_in};

#[derive(clap::Args)]
pub struct LimitArgs {
    /// The group (its members' VRAMCAP_GROUP).
    #[arg(long)]
    pub group: String,
    /// The members' VRAMCAP_GROUP_DIR (default: $VRAMCAP_GROUP_DIR, else
    /// /dev/shm/vramcap-<your uid>, as a member started from this environment would use).
    #[arg(long, value_name = "DIR")]
    pub group_dir: Option<String>,
    /// The new budget, in VRAMCAP_GROUP_LIMIT's grammar: one size for every device of the group
    /// (8GiB, 0 = no limit) or per device 0=8GiB,1=4GiB (the group's device numbers, as this
    /// command prints them) or GPU-<full UUID>=8GiB. Without it: print the budget.
    pub spec: Option<String>,
    /// Make a group in observe mode (VRAMCAP_MODE=observe) enforce its budget from now on: each
    /// member at its next allocation that does not fit (the other way needs every member to ask
    /// for observe: restart them with it).
    #[arg(long)]
    pub enforce: bool,
    /// Give back what the group keeps of ended members' exported VMM memory that it cannot
    /// decide about (an export vramcap could not watch): your word that no process will import
    /// it any more.
    #[arg(long)]
    pub drop_exports: bool,
    /// With --drop-exports: also what a lock still keeps, an fd open or an import held somewhere
    /// (your word that no process holds either).
    #[arg(long, requires = "drop_exports")]
    pub open_too: bool,
}

pub fn main(a: LimitArgs) -> Result<(), String> {
    if !group_name::valid(&a.group) {
        return Err(format!("invalid --group {:?}: expected {}", a.group, group_name::FORM));
    }
    let from_env = std::env::var("VRAMCAP_GROUP_DIR").ok().filter(|d| !d.trim().is_empty());
    let dir = a.group_dir.clone().or(from_env).unwrap_or_else(default_dir);
    let path = file::path_for(&dir, &a.group);
    let (m, owner) = file::open_with_owner(&path)?.ok_or_else(|| {
        format!("no group \"{}\": {} does not exist (is a member running with VRAMCAP_GROUP_DIR={dir}?)", a.group, path.display())
    })?;
    let s = m.shm;
    if a.spec.is_none() && !a.enforce && !a.drop_exports {
        // Dead members' charges are not use: give them back before showing `used`.
        reclaim_in(s);
        print!("{}", show(s, &a.group, owner));
        return Ok(());
    }
    let me = unsafe { libc::geteuid() };
    if me != 0 && me != owner {
        return Err(format!(
            "group \"{}\": its ledger {} belongs to uid {owner}; only that uid or root may change its budget or mode (you are uid \
             {me}); nothing changed",
            a.group,
            path.display()
        ));
    }
    if a.drop_exports {
        reclaim_in(s);
        let dropped = s.drop_exports(a.open_too);
        let what = if a.open_too { "undecidable or with an fd still open" } else { "undecidable" };
        for e in (0..shm::DEVICES).filter(|&e| dropped[e] > 0) {
            println!("group \"{}\" device {e}: gave back {} of ended members' exported memory ({what})", a.group, human(dropped[e]));
        }
        if dropped.iter().all(|&b| b == 0) {
            println!("group \"{}\": no exported memory of ended members to give back ({what})", a.group);
        }
    }
    if a.enforce {
        let was = if s.enforce() { "observe" } else { "enforce" };
        println!("group \"{}\": mode {was} -> enforce (each member refuses what does not fit from its next allocation on)", a.group);
    }
    let Some(spec) = a.spec else { return Ok(()) };
    let want = resolve(s, &spec)?;
    let show_b = |b: u64| if b == 0 { "no limit".to_string() } else { human(b) };
    for &(e, bytes) in &want {
        let old = s.operator_set_limit(e, bytes, me);
        println!("group \"{}\" device {e}: limit {} -> {}", a.group, show_b(old), show_b(bytes));
        let used = s.used(e);
        if bytes != 0 && used > bytes {
            println!(
                "  the group holds {}: nothing is taken away, new allocations are refused until it is under {}, and \
                 members give back idle pool and graph memory",
                human(used),
                human(bytes)
            );
        }
    }
    // Members trim what their pools and graphs keep unused at their next driver call.
    s.header.pressure.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    if let Some(line) = ceiling_note() {
        println!("{line}");
    }
    Ok(())
}

/// Device entries the spec names, with their new budget in bytes.
fn resolve(s: &Shared, spec: &str) -> Result<Vec<(usize, u64)>, String> {
    let bad = |why: String| format!("invalid limit {spec:?}: {why}");
    let entries = parse_list("VRAMCAP_GROUP_LIMIT", spec).map_err(|e| bad(format!("{}; expected {}", e.reason, e.expected)))?;
    let known: Vec<usize> = (0..shm::DEVICES).filter(|&e| s.devices[e].key.load(std::sync::atomic::Ordering::Acquire) != 0).collect();
    if known.is_empty() {
        return Err("the group has no device yet (no member has initialised CUDA): nothing to limit".into());
    }
    let mut out: Vec<(usize, u64)> = Vec::new();
    for en in &entries {
        let bytes = match en.size {
            Size::Unlimited => 0,
            Size::Bytes(b) => b,
            Size::Percent(_) => {
                return Err(bad(format!(
                    "`{}`: a percentage needs the device's size, which the group's ledger does not keep; give a size (8GiB)",
                    en.text
                )));
            }
        };
        let targets: Vec<usize> = match &en.key {
            None => known.clone(),
            Some(DeviceKey::Ordinal(i)) if known.contains(&(*i as usize)) => vec![*i as usize],
            Some(DeviceKey::Ordinal(i)) => {
                return Err(bad(format!("the group has no device {i} (its devices: {known:?})")));
            }
            Some(DeviceKey::Uuid(u)) => {
                // The ledger keeps a hash of each GPU's UUID: only the whole UUID finds it.
                let full = format!("GPU-{}", &u[4..]);
                let key = shm::device_key(&full);
                match known.iter().find(|&&e| s.devices[e].key.load(std::sync::atomic::Ordering::Acquire) == key) {
                    Some(&e) => vec![e],
                    None => {
                        return Err(bad(format!(
                            "no device of the group has UUID {full} (give the whole UUID: the ledger keeps only its hash)"
                        )));
                    }
                }
            }
        };
        for t in targets {
            out.retain(|&(e, _)| e != t);
            out.push((t, bytes));
        }
    }
    Ok(out)
}

/// The group's budget per device: limit and who set it, used, live members holding memory.
fn show(s: &Shared, name: &str, owner: u32) -> String {
    use std::sync::atomic::Ordering::Acquire;
    let live: Vec<usize> =
        (0..shm::SLOTS).filter(|&i| SlotWord::unpack(s.slots[i].word.load(Acquire)).state == State::Live).collect();
    let mut out = format!("group \"{name}\" (ledger owned by uid {owner}): {} live member(s)\n", live.len());
    out += if s.observing() {
        "mode: observe (every member asked for VRAMCAP_MODE=observe: nothing is refused; `vramcap limit --enforce` ends it)\n"
    } else {
        "mode: enforce\n"
    };
    for e in (0..shm::DEVICES).filter(|&e| s.devices[e].key.load(Acquire) != 0) {
        let limit = s.devices[e].limit.load(Acquire);
        let by = match s.limit_setter(e) {
            Some(b) if b.operator => format!(" (set with `vramcap limit` by uid {})", b.uid),
            Some(b) => format!(" (VRAMCAP_GROUP_LIMIT of a member, uid {})", b.uid),
            None => String::new(),
        };
        let holders = live.iter().filter(|&&i| s.slots[i].charge[e].load(Acquire) > 0).count();
        out += &format!(
            "device {e}: limit {}{by}, used {}, {holders} live member(s) holding memory\n",
            if limit == 0 { "none".to_string() } else { human(limit) },
            human(s.used(e))
        );
        out += &kept_line(s.kept_exports()[e]);
    }
    if let Some(line) = ceiling_note() {
        out += &line;
        out.push('\n');
    }
    out
}

/// What `used` holds of ended members' exported VMM memory, and what gives it back.
fn kept_line(k: vramcap_common::group_ledger::kept::KeptBytes) -> String {
    let mut parts = Vec::new();
    if k.open > 0 {
        parts.push(format!("{} with an fd still open or imported somewhere (back when the last copy and import end)", human(k.open)));
    }
    if k.unsure > 0 {
        parts.push(format!("{} undecidable (exports vramcap could not watch: back with --drop-exports)", human(k.unsure)));
    }
    if k.imported > 0 {
        parts.push(format!("{} held by imports of unknown origin (back when members' such imports end)", human(k.imported)));
    }
    if parts.is_empty() { String::new() } else { format!("  of which exported by ended members: {}\n", parts.join(", ")) }
}

/// What the machine's ceiling file holds each member to, whatever the group's budget.
fn ceiling_note() -> Option<String> {
    let text = ceiling::read_file(ceiling::PATH).ok()??;
    let c = ceiling::merge(Some((ceiling::PATH, &text)), &[], false);
    let ceil = c.ceiling?;
    let texts = |l: &vramcap_common::grammar::limits::LimitSpec| l.entries.iter().map(|e| e.text.clone()).collect::<Vec<_>>().join(",");
    let mut parts = Vec::new();
    if !ceil.group_limits.is_empty() {
        parts.push(format!("VRAMCAP_GROUP_LIMIT={}", texts(&ceil.group_limits)));
    }
    if !ceil.limits.is_empty() {
        parts.push(format!("VRAMCAP_LIMIT={}", texts(&ceil.limits)));
    }
    (!parts.is_empty()).then(|| {
        format!("note: {} sets {}: each member is held to it whatever the group's budget", ceiling::PATH, parts.join(" and "))
    })
}
