//! Group budgets: members sharing a ledger, hostile and unlucky members, the sharing policies.

mod group;
mod group_hostile;
mod group_observe;
mod group_overhead;
mod group_policy;
mod group_sharing;
mod exported;
mod exported_open;
mod exported_unlock;
mod exported_attack;
mod exported_attack2;
mod scene;
mod live_budget;
mod replay_agrees;
