//! `vramcap limit --group NAME [--group-dir DIR] [--enforce] [SPEC]`: print or change a running
//! group's budget in its ledger (issue 26), or turn an observing group to enforce. Members judge every allocation against the ledger's limit
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
    if a.spec.is_none() && !a.enforce {
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
    }
    if let Some(line) = ceiling_note() {
        out += &line;
        out.push('\n');
    }
    out
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
