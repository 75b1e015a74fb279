//! `vramcap replay --policy`: one vramcap group of the replayed traces, simulated as the group
//! admits allocations (docs/analysis.md, "Group policies").
//!
//! Per device: budget L, headroom H. Member m has charge c, reserve r, priority p and unmet
//! reserve u = max(0, r - c) (less what higher-priority members took); held = Σ c + Σ u over the
//! live members.
//! - Start: the reserve is claimed if held + r <= L - H, else it is refused (the member runs with
//!   reserve 0). A member starting while the others hold memory (Σ c > 0 on any device) and
//!   nobody holds the headroom becomes its holder, for every device, until it ends.
//! - Allocation of s: t = min(s, u_m); granted iff t = s (all from its own reserve) or
//!   held - t + s <= L - H (holder: <= L).
//!   `equal` also needs c_m + s <= (L - H) / N (+ H for the holder), N live members; `priority`
//!   may cover a shortfall from the unmet reserves of strictly lower-priority members (lowest
//!   priority first, then the latest started), all or nothing.
//! - Free of s: c_m -= s, and the unmet reserve refills by up to s.
//!
//! As in the plain replay, a denied allocation is still applied (what the job did next is not in
//! its trace): denials are counted and the first per member is kept.

use super::stats::next_used;
use super::trace::{Event, Op};
use crate::size::human;

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
        match self {
            Policy::Shared => "shared",
            Policy::Equal => "equal",
            Policy::Priority => "priority",
        }
    }
}

/// Why an allocation (or a reserve) was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    Budget,
    /// Equal share `share` of `limit` among `n` members.
    Equal { share: u64, limit: u64, n: usize },
    Priority,
    Headroom,
    ReserveAtStart,
}

impl Rule {
    pub fn text(self) -> String {
        match self {
            Rule::Budget => "group budget".into(),
            Rule::Equal { share, limit, n } => format!("equal share {} of {} among {n} members", human(share), human(limit)),
            Rule::Priority => "reserved for higher priority".into(),
            Rule::Headroom => "headroom kept for a later member".into(),
            Rule::ReserveAtStart => "reserve does not fit at start".into(),
        }
    }

    /// A stable name for JSON.
    pub fn key(self) -> &'static str {
        match self {
            Rule::Budget => "budget",
            Rule::Equal { .. } => "equal_share",
            Rule::Priority => "priority",
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
}

/// One device as the group sees it: its budget and headroom (0: none) and each member's reserve.
pub struct DevCfg {
    pub index: i32,
    pub limit: u64,
    pub headroom: u64,
    pub reserve: Vec<u64>,
}

struct Dev {
    cfg: DevCfg,
    c: Vec<u64>,
    u: Vec<u64>,
    /// The reserve in force (0 once refused at start).
    r: Vec<u64>,
}

pub struct Sim {
    pub policy: Policy,
    priority: Vec<i64>,
    live: Vec<bool>,
    rank: Vec<u64>,
    next_rank: u64,
    devs: Vec<Dev>,
    /// The member holding the headroom: one for the whole group, as in the ledger.
    holder: Option<usize>,
    /// Per member: allocations denied, the first denial, reserves refused at start.
    pub denials: Vec<u64>,
    pub first: Vec<Option<Denial>>,
    pub refused: Vec<Vec<Denial>>,
    /// Per member: bytes taken from lower-priority members' reserves / taken from its reserve.
    pub took: Vec<u64>,
    pub lost: Vec<u64>,
    /// Per member and device: whether it held the headroom at some point.
    pub held_headroom: Vec<Vec<i32>>,
    pub total: u64,
    pub first_overall: Option<(usize, Denial)>,
}

impl Sim {
    pub fn new(policy: Policy, priority: Vec<i64>) -> Sim {
        let n = priority.len();
        Sim {
            policy,
            priority,
            live: vec![false; n],
            rank: vec![0; n],
            next_rank: 0,
            devs: Vec::new(),
            holder: None,
            denials: vec![0; n],
            first: vec![None; n],
            refused: vec![Vec::new(); n],
            took: vec![0; n],
            lost: vec![0; n],
            held_headroom: vec![Vec::new(); n],
            total: 0,
            first_overall: None,
        }
    }

    /// The devices met so far, in the order met.
    pub fn devices(&self) -> impl Iterator<Item = &DevCfg> {
        self.devs.iter().map(|d| &d.cfg)
    }

    pub fn fits(&self) -> bool {
        self.total == 0
    }

    pub fn has_device(&self, index: i32) -> bool {
        self.devs.iter().any(|d| d.cfg.index == index)
    }

    /// A device the group meets at `t`: the members already live claim their reserves on it now,
    /// in the order they started.
    pub fn add_device(&mut self, cfg: DevCfg, t: u64) {
        let n = self.live.len();
        self.devs.push(Dev { cfg, c: vec![0; n], u: vec![0; n], r: vec![0; n] });
        let k = self.devs.len() - 1;
        let mut order: Vec<usize> = (0..n).filter(|&i| self.live[i]).collect();
        order.sort_by_key(|&i| self.rank[i]);
        for i in order {
            self.claim(k, i, t);
        }
    }

    pub fn start(&mut self, i: usize, t: u64) {
        self.live[i] = true;
        self.rank[i] = self.next_rank;
        self.next_rank += 1;
        // The headroom's holder (group-wide, as `group::sharing::join`): a member starting while
        // others hold memory on any device and no live member holds it.
        let others_hold = self.devs.iter().any(|d| (0..self.live.len()).any(|j| j != i && self.live[j] && d.c[j] > 0));
        if self.holder.is_none() && others_hold && self.devs.iter().any(|d| d.cfg.headroom > 0) {
            self.holder = Some(i);
            let devs: Vec<i32> = self.devs.iter().filter(|d| d.cfg.headroom > 0).map(|d| d.cfg.index).collect();
            self.held_headroom[i].extend(devs);
        }
        for k in 0..self.devs.len() {
            self.claim(k, i, t);
        }
    }

    pub fn end(&mut self, i: usize) {
        self.live[i] = false;
        for d in &mut self.devs {
            d.c[i] = 0;
            d.u[i] = 0;
        }
        if self.holder == Some(i) {
            self.holder = None;
        }
    }

    fn held(&self, k: usize) -> u64 {
        let d = &self.devs[k];
        (0..self.live.len()).filter(|&j| self.live[j]).map(|j| d.c[j].saturating_add(d.u[j])).fold(0u64, u64::saturating_add)
    }

    fn claim(&mut self, k: usize, i: usize, t: u64) {
        let held = self.held(k);
        let d = &mut self.devs[k];
        let r = d.cfg.reserve[i];
        if r == 0 {
            return;
        }
        if d.cfg.limit > 0 && held.saturating_add(r) > d.cfg.limit.saturating_sub(d.cfg.headroom) {
            let dev = d.cfg.index;
            self.refused[i].push(Denial { t, dev, size: r, api: None, rule: Rule::ReserveAtStart });
            self.deny(i, Denial { t, dev, size: r, api: None, rule: Rule::ReserveAtStart });
            return;
        }
        d.r[i] = r;
        d.u[i] = r.saturating_sub(d.c[i]);
    }

    fn deny(&mut self, i: usize, x: Denial) {
        self.denials[i] += 1;
        self.total += 1;
        self.first[i].get_or_insert(x);
        if self.first_overall.is_none() {
            self.first_overall = Some((i, x));
        }
    }

    /// Event `e` of member `i` at `t`; its device must have been added.
    pub fn event(&mut self, i: usize, e: &Event, t: u64) {
        let Some(k) = self.devs.iter().position(|d| d.cfg.index == e.dev) else { return };
        let old = self.devs[k].c[i];
        let new = next_used(old, e);
        if new < old {
            let d = &mut self.devs[k];
            d.c[i] = new;
            let room = d.r[i].saturating_sub(new);
            if room > d.u[i] {
                d.u[i] += (old - new).min(room - d.u[i]);
            }
            return;
        }
        let s = new - old;
        let checked = e.op == Op::Alloc && self.devs[k].cfg.limit > 0;
        if let Some(rule) = checked.then(|| self.admit(k, i, s).err()).flatten() {
            self.deny(i, Denial { t, dev: e.dev, size: s, api: Some(e.api), rule });
        }
        let d = &mut self.devs[k];
        let own = s.min(d.u[i]);
        d.u[i] -= own;
        d.c[i] = new;
    }

    /// The admission check for `s` bytes by member `i` on device `k`; takes lower-priority
    /// reserves when that is what lets it through.
    fn admit(&mut self, k: usize, i: usize, s: u64) -> Result<(), Rule> {
        let held = self.held(k);
        let n_live = self.live.iter().filter(|&&l| l).count().max(1);
        let (pi, policy) = (self.priority[i], self.policy);
        let live: Vec<usize> = (0..self.live.len()).filter(|&j| j != i && self.live[j]).collect();
        let d = &self.devs[k];
        let (l, h) = (d.cfg.limit, d.cfg.headroom);
        let holder = self.holder == Some(i);
        let cap = if holder { l } else { l.saturating_sub(h) };
        let new_held = held.saturating_sub(s.min(d.u[i])).saturating_add(s);
        // Under `priority`, what the lower members' unmet reserves could cover, in taking order.
        let mut lower: Vec<usize> = if policy == Policy::Priority {
            live.iter().copied().filter(|&j| self.priority[j] < pi && d.u[j] > 0).collect()
        } else {
            Vec::new()
        };
        lower.sort_by_key(|&j| (self.priority[j], std::cmp::Reverse(self.rank[j])));
        let takeable: u64 = lower.iter().map(|&j| d.u[j]).sum();
        // All of it from the member's own unmet reserve: already counted in `held` and kept for
        // it whatever the others hold (even past the budget, when the headroom's holder uses the
        // headroom), as `group::admit` grants it: no budget check, only `equal`'s share below.
        if s > d.u[i] && new_held > cap {
            let need = new_held - cap;
            if takeable < need {
                let higher: u64 = if policy == Policy::Priority { live.iter().filter(|&&j| self.priority[j] > pi).map(|&j| d.u[j]).sum() } else { 0 };
                let without_lower = new_held - takeable;
                return Err(if higher > 0 && without_lower.saturating_sub(higher) <= cap {
                    Rule::Priority
                } else if !holder && h > 0 && without_lower <= l {
                    Rule::Headroom
                } else {
                    Rule::Budget
                });
            }
            let mut need = need;
            let d = &mut self.devs[k];
            for j in lower {
                let x = need.min(d.u[j]);
                d.u[j] -= x;
                self.lost[j] += x;
                self.took[i] += x;
                need -= x;
                if need == 0 {
                    break;
                }
            }
            return Ok(());
        }
        if policy == Policy::Equal {
            let share = l.saturating_sub(h) / n_live as u64 + if holder { h } else { 0 };
            if d.c[i].saturating_add(s) > share {
                return Err(Rule::Equal { share, limit: l, n: n_live });
            }
        }
        Ok(())
    }
}
