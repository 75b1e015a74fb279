//! `vramcap replay --policy`: the replayed traces as one vramcap group, admitted by the library's
//! own code. Each policy gets a group ledger in memory (`Shared::in_memory`: the bytes a mapped
//! ledger file holds) and every member's start, allocation, free and end runs the functions the
//! library runs on the mapped file (`Shared::join`, `charge`, `uncharge`, `reclaim`), so the
//! replay and the library cannot disagree about a grant or a denial (docs/analysis.md, "Group
//! policies"; tests/group/group_policy.rs compares the two on recorded traces).
//!
//! What the replay adds around that code:
//! - a member starts at its trace's offset and ends when its trace does (its slot reclaimed, as
//!   the sidecar or a neighbour reclaims a dead member's);
//! - a reserve refused at start is recorded, and the member runs with none (the library refuses
//!   such a member's CUDA initialisation; what the job would have done then is not in its trace);
//! - a denied allocation is still applied (the job held that memory in its trace: what it would
//!   have done after a denial is unknowable), with no rule (`charge_unchecked`);
//! - a denial recorded in a trace is judged as a request too, and counted apart: whether the
//!   replay, like the recorded run, refuses it; refused, it is a denial of the replay (demand the
//!   job had), never charged.

use super::stats::next_used;
use super::trace::{Event, Op};
use vramcap_common::grammar::size::human;
use vramcap_common::group_ledger::join::{Refused, Request};
use vramcap_common::group_ledger::shm::{self, Shared};
use std::sync::atomic::Ordering::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Policy {
    /// One budget for all (the group as it is today), plus reserves and headroom if given.
    Shared,
    /// Also: no member above an equal share of the budget among the live members.
    Equal,
    /// Also: a member may take the unmet reserves of lower-priority members.
    Priority,
}

impl Policy {
    pub const ALL: [Policy; 3] = [Policy::Shared, Policy::Equal, Policy::Priority];

    pub fn name(self) -> &'static str {
        self.ledger().name()
    }

    fn ledger(self) -> shm::Policy {
        match self {
            Policy::Shared => shm::Policy::Shared,
            Policy::Equal => shm::Policy::Equal,
            Policy::Priority => shm::Policy::Priority,
        }
    }
}

/// Why an allocation (or a reserve) was refused: the ledger's rule, as the library's denial
/// line states it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    Budget,
    /// `equal`: share `share` of `budget` (the limit less the headroom) among `n` members.
    Equal { share: u64, budget: u64, n: u64 },
    /// Unmet reserves of others; under `priority`, of higher priorities only.
    Reserved { higher: bool },
    Headroom,
    ReserveAtStart,
}

impl Rule {
    fn of(r: shm::Rule) -> Rule {
        match r {
            shm::Rule::Budget => Rule::Budget,
            shm::Rule::Headroom { .. } => Rule::Headroom,
            shm::Rule::Share { share, budget, members } => Rule::Equal { share, budget, n: members },
            shm::Rule::Reserved { higher, .. } => Rule::Reserved { higher },
        }
    }

    pub fn text(self) -> String {
        match self {
            Rule::Budget => "group budget".into(),
            Rule::Equal { share, budget, n } => format!("equal share {} of {} among {n} members", human(share), human(budget)),
            Rule::Reserved { higher: true } => "reserved for higher priority".into(),
            Rule::Reserved { higher: false } => "reserved for other members".into(),
            Rule::Headroom => "headroom kept for a later member".into(),
            Rule::ReserveAtStart => "reserve does not fit at start".into(),
        }
    }

    /// A stable name for JSON.
    pub fn key(self) -> &'static str {
        match self {
            Rule::Budget => "budget",
            Rule::Equal { .. } => "equal_share",
            Rule::Reserved { higher: true } => "priority",
            Rule::Reserved { higher: false } => "reserved",
            Rule::Headroom => "headroom",
            Rule::ReserveAtStart => "reserve_at_start",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Denial {
    pub t: u64,
    pub dev: i32,
    pub size: u64,
    /// The call (interned name); `None` for a reserve refused at start.
    pub api: Option<u16>,
    pub rule: Rule,
    /// A request the recorded run was refused (a `deny` event) that the replay refuses too.
    pub recorded: bool,
}

/// One device as the group sees it: its budget and headroom (0: none) and each member's reserve.
pub struct DevCfg {
    pub index: i32,
    pub limit: u64,
    pub headroom: u64,
    pub reserve: Vec<u64>,
}

pub struct Sim {
    pub policy: Policy,
    ledger: Box<Shared>,
    priority: Vec<i64>,
    /// Per member: its slot in the ledger while it runs.
    slot: Vec<Option<usize>>,
    started: u64,
    /// The devices met so far, in the order met, and their ledger entries.
    devs: Vec<DevCfg>,
    entries: Vec<usize>,
    /// Per device and member: what the member's trace says it holds.
    used: Vec<Vec<u64>>,
    /// Per member: allocations denied, the first denial, reserves refused at start.
    pub denials: Vec<u64>,
    pub first: Vec<Option<Denial>>,
    pub refused: Vec<Vec<Denial>>,
    /// Per member: bytes taken from lower-priority members' reserves / taken from its reserve.
    pub took: Vec<u64>,
    pub lost: Vec<u64>,
    /// Per member: the devices where it held the headroom.
    pub held_headroom: Vec<Vec<i32>>,
    /// Per member: denials recorded in its trace, and those of them the replay would grant.
    pub recorded_denials: Vec<u64>,
    pub recorded_granted: Vec<u64>,
    pub total: u64,
    pub first_overall: Option<(usize, Denial)>,
    /// Denials per device, in the order met.
    dev_denials: Vec<(i32, u64)>,
}

impl Sim {
    pub fn new(policy: Policy, priority: Vec<i64>) -> Sim {
        let n = priority.len();
        Sim {
            policy,
            ledger: Shared::in_memory("replay"),
            priority,
            slot: vec![None; n],
            started: 0,
            devs: Vec::new(),
            entries: Vec::new(),
            used: Vec::new(),
            denials: vec![0; n],
            first: vec![None; n],
            refused: vec![Vec::new(); n],
            took: vec![0; n],
            lost: vec![0; n],
            held_headroom: vec![Vec::new(); n],
            recorded_denials: vec![0; n],
            recorded_granted: vec![0; n],
            total: 0,
            first_overall: None,
            dev_denials: Vec::new(),
        }
    }

    /// The devices met so far, in the order met.
    pub fn devices(&self) -> impl Iterator<Item = &DevCfg> {
        self.devs.iter()
    }

    pub fn fits(&self) -> bool {
        self.total == 0
    }

    pub fn has_device(&self, index: i32) -> bool {
        self.devs.iter().any(|d| d.index == index)
    }

    /// A device the group meets at `t`: its budget is set, and the members already running claim
    /// their reserves on it now, in the order they started.
    pub fn add_device(&mut self, cfg: DevCfg, t: u64) {
        let s = &self.ledger;
        let e = s.device_entry(shm::device_key(&format!("ordinal-{}", cfg.index))).expect("a ledger has room for every device a trace names");
        s.set_limit(e, cfg.limit);
        if s.devices[e].headroom.load(Acquire) == 0 {
            s.set_headroom(e, 0, cfg.headroom);
        }
        let mut running: Vec<(u64, usize, usize)> = (0..self.slot.len())
            .filter_map(|i| self.slot[i].map(|j| (s.slots[j].start.load(Acquire), i, j)))
            .collect();
        running.sort_unstable();
        let refused: Vec<usize> = running.into_iter().filter(|&(_, i, j)| cfg.reserve[i] > 0 && s.claim_reserve(j, e, cfg.reserve[i]).is_err()).map(|(_, i, _)| i).collect();
        for i in refused {
            self.refuse(i, Denial { t, dev: cfg.index, size: cfg.reserve[i], api: None, rule: Rule::ReserveAtStart, recorded: false });
        }
        self.used.push(vec![0; self.slot.len()]);
        self.devs.push(cfg);
        self.entries.push(e);
    }

    /// The group's budget on device `index` changes to `bytes` (0 = none), as `vramcap limit` or a
    /// member's setting changes it in a running group: the next request is judged by it.
    pub fn set_limit(&mut self, index: i32, bytes: u64) {
        if let Some(k) = self.devs.iter().position(|d| d.index == index) {
            self.ledger.set_limit(self.entries[k], bytes);
            self.devs[k].limit = bytes;
        }
    }

    /// Member `i` starts at `t`: it joins the group as the library's members join at CUDA init.
    pub fn start(&mut self, i: usize, t: u64) {
        let s = &self.ledger;
        self.started += 1;
        let slot = s.claim(i as u32 + 1, self.started, 0).expect("a ledger has a slot for every trace");
        let headroom: Vec<u64> = self.devs.iter().map(|d| d.headroom).collect();
        let reserve: Vec<u64> = self.devs.iter().map(|d| d.reserve[i]).collect();
        let mut req = Request { policy: Some(self.policy.ledger()), priority: self.priority[i], mode: vramcap_common::config::CapMode::Enforce, headroom: Some(&headroom), reserve: &reserve };
        let none = |_: &Shared| {};
        let joined = match s.join(slot, &self.entries, &req, &none) {
            Ok(j) => j,
            Err(Refused::Reserve { d, bytes, .. }) => {
                let dev = self.devs[d].index;
                self.refuse(i, Denial { t, dev, size: bytes, api: None, rule: Rule::ReserveAtStart, recorded: false });
                req.reserve = &[];
                self.ledger.join(slot, &self.entries, &req, &none).unwrap_or_default()
            }
            // Every member asks for the same policy and headroom: a group of one replay agrees.
            Err(_) => Default::default(),
        };
        if joined.holds_headroom {
            self.note_holder(i);
        }
        self.slot[i] = Some(slot);
    }

    /// Member `i` holds the headroom (from its start, or since a request of its own took it).
    fn note_holder(&mut self, i: usize) {
        if self.held_headroom[i].is_empty() {
            self.held_headroom[i] = self.devs.iter().filter(|d| d.headroom > 0).map(|d| d.index).collect();
        }
    }

    /// Member `i`'s trace ended: its slot is reclaimed, with everything it held.
    pub fn end(&mut self, i: usize) {
        let Some(slot) = self.slot[i].take() else { return };
        let w = self.ledger.slots[slot].word.load(Acquire);
        self.ledger.reclaim(slot, w, 0);
        for d in &mut self.used {
            d[i] = 0;
        }
    }

    fn refuse(&mut self, i: usize, x: Denial) {
        self.refused[i].push(x);
        self.deny(i, x);
    }

    /// Denials on device `index`.
    pub fn denials_on(&self, index: i32) -> u64 {
        self.dev_denials.iter().find(|d| d.0 == index).map_or(0, |d| d.1)
    }

    fn deny(&mut self, i: usize, x: Denial) {
        match self.dev_denials.iter_mut().find(|d| d.0 == x.dev) {
            Some(d) => d.1 += 1,
            None => self.dev_denials.push((x.dev, 1)),
        }
        self.denials[i] += 1;
        self.total += 1;
        self.first[i].get_or_insert(x);
        if self.first_overall.is_none() {
            self.first_overall = Some((i, x));
        }
    }

    /// Event `e` of member `i` at `t`; its device must have been added.
    pub fn event(&mut self, i: usize, e: &Event, t: u64) {
        let (Some(k), Some(slot)) = (self.devs.iter().position(|d| d.index == e.dev), self.slot[i]) else { return };
        let entry = self.entries[k];
        if e.op == Op::Deny {
            // The recorded run refused this request: would the replay?
            // Refused here too, it is a denial of the replay: the job asked for this much more at
            // that moment (its usage + the size), so a limit it was denied at does not "fit".
            self.recorded_denials[i] += 1;
            match self.ledger.probe(slot, entry, e.size) {
                Ok(()) => self.recorded_granted[i] += 1,
                Err(over) => self.deny(i, Denial { t, dev: e.dev, size: e.size, api: Some(e.api), rule: Rule::of(over.rule), recorded: true }),
            }
            return;
        }
        let old = self.used[k][i];
        let new = next_used(old, e);
        self.used[k][i] = new;
        if new < old {
            self.ledger.uncharge(slot, entry, old - new);
            return;
        }
        let size = new - old;
        if size == 0 {
            return;
        }
        if e.op != Op::Alloc {
            // Memory the driver handed out without a request of its own (a pool growing, a
            // context's): it exists, no rule applies.
            self.ledger.charge_unchecked(slot, entry, size);
            return;
        }
        let before = self.unmet(entry);
        match self.ledger.charge(slot, entry, size) {
            Ok(()) => {
                if self.ledger.holds_headroom(slot) {
                    self.note_holder(i);
                }
                // Under `priority`, what this grant took from lower members' unmet reserves.
                for (j, (b, a)) in before.iter().zip(self.unmet(entry)).enumerate() {
                    if j != i && a < *b {
                        self.lost[j] += b - a;
                        self.took[i] += b - a;
                    }
                }
            }
            Err(over) => {
                self.deny(i, Denial { t, dev: e.dev, size, api: Some(e.api), rule: Rule::of(over.rule), recorded: false });
                self.ledger.charge_unchecked(slot, entry, size);
            }
        }
    }

    /// Each member's unmet reserve on ledger entry `e` (0 for one not running).
    fn unmet(&self, e: usize) -> Vec<u64> {
        self.slot.iter().map(|s| s.map_or(0, |j| self.ledger.slots[j].unmet[e].load(Acquire))).collect()
    }
}
