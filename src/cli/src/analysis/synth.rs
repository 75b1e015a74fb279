//! `vramcap gen-trace` (hidden): writes a synthetic, internally consistent trace for benchmarks
//! and tests — random sizes (log-uniform), random frees, denials at the cap, rare driver failures.

use std::io::{BufWriter, Write};
use std::path::Path;

pub struct GenOpts {
    pub events: u64,
    pub seed: u64,
    pub pid: u64,
    pub devices: u32,
    pub limit: u64,
    pub total: u64,
    pub start_unix_ns: u64,
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*: deterministic for a given seed, good enough for workloads.
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

pub fn generate(path: &Path, o: &GenOpts) -> Result<(), String> {
    let f = super::output::create(path)?;
    let mut w = BufWriter::with_capacity(1 << 20, f);
    let io = |e: std::io::Error| format!("{}: write error: {e}", path.display());
    let devs: Vec<String> = (0..o.devices).map(|d| format!(r#"{{"index":{d},"total":{},"limit":{}}}"#, o.total, o.limit)).collect();
    writeln!(
        w,
        r#"{{"type":"header","version":1,"pid":{},"ppid":1,"exe":"python3","cmdline":["python3","train.py"],"host":"gen","start_unix_ns":{},"devices":[{}],"group":null}}"#,
        o.pid, o.start_unix_ns, devs.join(",")
    )
    .map_err(io)?;
    let mut rng = Rng(o.seed.max(1));
    let mut live: Vec<Vec<(u64, u64)>> = vec![Vec::new(); o.devices as usize];
    let mut used = vec![0u64; o.devices as usize];
    let mut peak = vec![0u64; o.devices as usize];
    let mut t = 0u64;
    let mut next_ptr = 0x7f00_0000_0000u64;
    let tid = o.pid + 1;
    for seq in 0..o.events {
        t += 100 + rng.below(4900);
        let d = rng.below(o.devices as u64) as usize;
        // Hover around a few thousand live allocations so the live table stays realistic.
        let want_free = !live[d].is_empty() && rng.below(4096) < live[d].len() as u64;
        let (op, api, ptr, size, result, dur) = if want_free {
            let k = rng.below(live[d].len() as u64) as usize;
            let (p, s) = live[d].swap_remove(k);
            used[d] -= s;
            ("free", "cuMemFree_v2", p, s, 0, 200 + rng.below(2000))
        } else {
            let size = 1u64 << (9 + rng.below(20));
            let size = size + rng.below(size);
            if rng.below(5000) == 0 {
                ("fail", "cuMemAlloc_v2", 0, size, 2, 500 + rng.below(5000))
            } else if o.limit > 0 && used[d] + size > o.limit {
                ("deny", "cuMemAlloc_v2", 0, size, 2, 0)
            } else {
                let p = next_ptr;
                next_ptr += 0x20_0000;
                live[d].push((p, size));
                used[d] += size;
                peak[d] = peak[d].max(used[d]);
                ("alloc", if rng.below(8) == 0 { "cuMemAllocAsync" } else { "cuMemAlloc_v2" }, p, size, 0, 500 + rng.below(20000))
            }
        };
        writeln!(
            w,
            r#"{{"type":"event","seq":{seq},"t_ns":{t},"tid":{tid},"op":"{op}","api":"{api}","dev":{d},"ptr":"{ptr:#x}","size":{size},"result":{result},"dur_ns":{dur},"used":{}}}"#,
            used[d]
        )
        .map_err(io)?;
    }
    let map = |v: &[u64]| v.iter().enumerate().map(|(d, b)| format!(r#""{d}":{b}"#)).collect::<Vec<_>>().join(",");
    writeln!(w, r#"{{"type":"summary","events":{},"dropped":0,"peak":{{{}}},"used":{{{}}}}}"#, o.events, map(&peak), map(&used)).map_err(io)?;
    w.flush().map_err(io)
}
