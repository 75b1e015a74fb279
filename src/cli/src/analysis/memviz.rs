//! `vramcap export --format memory-viz`: a pickle in the layout of PyTorch's
//! `torch.cuda.memory._snapshot()` (`segments`, `device_traces`), which pytorch.org/memory_viz
//! and `torch.cuda._memory_viz` open. At the driver level every charged allocation is its own
//! segment holding one block, so each `alloc` becomes `segment_alloc` + `alloc`, each `free`
//! `free_completed` + `segment_free`, and each denial an `oom`. Frames name the driver entry
//! point and the process (there is no Python stack at this level).
//!
//! Streaming: each trace list is written to its own part file as events arrive and the parts
//! are concatenated at the end (pickle fragments without a memo are position-independent);
//! only the live allocations (the final `segments`) are held in memory.

use super::export::Window;
use super::merge::{Align, Merged};
use super::pickle::Pickler;
use super::stats::{PtrMap, next_used};
use super::trace::Op;
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// Items per MARK … APPENDS batch: keeps the unpickler's stack small.
const BATCH: u32 = 1000;

struct Slot {
    proc_idx: usize,
    dev: i32,
    part: PathBuf,
    p: Pickler<BufWriter<File>>,
    in_batch: u32,
    live: PtrMap<(u64, u16)>,
    used: u64,
    limit: u64,
}

impl Slot {
    fn item(&mut self) -> io::Result<()> {
        if self.in_batch == BATCH {
            self.p.appends()?;
            self.p.mark()?;
            self.in_batch = 0;
        }
        self.in_batch += 1;
        Ok(())
    }
}

fn frames(p: &mut Pickler<impl Write>, api: &str, pid: u64) -> io::Result<()> {
    p.str("frames")?;
    p.empty_list()?;
    p.mark()?;
    p.empty_dict()?;
    p.mark()?;
    p.key_str("filename", api)?;
    p.key_int("line", 0)?;
    p.key_str("name", &format!("{api} (pid {pid})"))?;
    p.setitems()?;
    p.appends()
}

fn entry(p: &mut Pickler<impl Write>, action: &str, addr: Option<u64>, size: u64, time_us: u64, api: &str, pid: u64, device_free: Option<u64>) -> io::Result<()> {
    p.empty_dict()?;
    p.mark()?;
    p.key_str("action", action)?;
    if let Some(a) = addr {
        p.key_int("addr", a as i128)?;
    }
    p.key_int("size", size as i128)?;
    p.key_int("stream", 0)?;
    p.key_int("time_us", time_us as i128)?;
    if let Some(f) = device_free {
        p.key_int("device_free", f as i128)?;
    }
    frames(p, api, pid)?;
    p.setitems()
}

pub fn export(paths: &[PathBuf], out: &Path, w: Window) -> Result<(), String> {
    if w.from > w.to {
        return Err("--from is after --to".into());
    }
    let mut m = Merged::open(paths, Align::WallClock)?;
    let single = m.readers.len() == 1;
    let mut slots: Vec<Slot> = Vec::new();
    let io_err = |e: io::Error| format!("{}: write error: {e}", out.display());
    let (mut end_t, mut exported) = (None, false);
    let r = (|| -> Result<(), String> {
        while let Some((i, e, t)) = m.next() {
            if t > w.to {
                break;
            }
            end_t = Some(t);
            exported |= t >= w.from;
            if e.dev < 0 {
                continue;
            }
            let k = match slots.iter().position(|s| s.proc_idx == i && s.dev == e.dev) {
                Some(k) => k,
                None => {
                    // Beside the output; for standard output, in the temporary directory.
                    let part = if super::output::is_stdout(out) {
                        std::env::temp_dir().join(format!("vramcap-memviz-{}.part{}", std::process::id(), slots.len()))
                    } else {
                        PathBuf::from(format!("{}.part{}", out.display(), slots.len()))
                    };
                    let f = File::create(&part).map_err(|e| format!("{}: cannot create: {e}", part.display()))?;
                    let mut p = Pickler::new(BufWriter::new(f));
                    p.mark().map_err(io_err)?;
                    let h = &m.readers[i].header;
                    let limit = h.devices.iter().find(|d| d.index == e.dev).map(|d| d.limit.unwrap_or(d.total)).unwrap_or(0);
                    slots.push(Slot { proc_idx: i, dev: e.dev, part, p, in_batch: 0, live: PtrMap::default(), used: 0, limit });
                    slots.len() - 1
                }
            };
            let h = &m.readers[i].header;
            let (pid, time_us) = (h.pid, (h.start_unix_ns + e.t_ns) / 1000);
            let api = m.names.get(e.api);
            let s = &mut slots[k];
            s.used = next_used(s.used, &e);
            let in_window = t >= w.from;
            match e.op {
                Op::Alloc => {
                    s.live.insert(e.ptr, (e.size, e.api));
                    if in_window {
                        s.item().map_err(io_err)?;
                        entry(&mut s.p, "segment_alloc", Some(e.ptr), e.size, time_us, api, pid, None).map_err(io_err)?;
                        s.item().map_err(io_err)?;
                        entry(&mut s.p, "alloc", Some(e.ptr), e.size, time_us, api, pid, None).map_err(io_err)?;
                    }
                }
                Op::Free => {
                    s.live.remove(&e.ptr);
                    if in_window {
                        s.item().map_err(io_err)?;
                        entry(&mut s.p, "free_completed", Some(e.ptr), e.size, time_us, api, pid, None).map_err(io_err)?;
                        s.item().map_err(io_err)?;
                        entry(&mut s.p, "segment_free", Some(e.ptr), e.size, time_us, api, pid, None).map_err(io_err)?;
                    }
                }
                Op::Deny if in_window => {
                    let free = s.limit.saturating_sub(s.used);
                    s.item().map_err(io_err)?;
                    entry(&mut s.p, "oom", None, e.size, time_us, api, pid, Some(free)).map_err(io_err)?;
                }
                _ => {}
            }
        }
        m.finish_progress();
        assemble(&m, &mut slots, single, out)
    })();
    for s in &slots {
        let _ = fs::remove_file(&s.part);
    }
    r?;
    m.warn_input();
    super::export::past_the_end(out, w, end_t, exported)
}

/// Device ordinals above this are not real GPUs of one process.
const MAX_ORDINAL: i32 = 1024;

/// Writes the snapshot: `device_traces` from the part files, `segments` from the live tables.
/// With one trace, list index = CUDA ordinal; with several, one list per (process, device).
fn assemble(m: &Merged, slots: &mut [Slot], single: bool, out: &Path) -> Result<(), String> {
    let io_err = |e: io::Error| format!("{}: write error: {e}", out.display());
    for s in slots.iter_mut() {
        s.p.appends().map_err(io_err)?;
        s.p.w.flush().map_err(io_err)?;
    }
    slots.sort_by_key(|s| (s.proc_idx, s.dev));
    // List index = CUDA ordinal only for plausible ordinals: a corrupt trace's device 1879048192
    // (or -1) must not become billions of empty lists (found by fuzzing: it hung the export).
    let single = single && slots.iter().all(|s| (0..MAX_ORDINAL).contains(&s.dev));
    let index_of = |k: usize, s: &Slot| if single { s.dev as usize } else { k };
    let n = slots.iter().enumerate().map(|(k, s)| index_of(k, s) + 1).max().unwrap_or(0);
    let f = super::output::create(out)?;
    let mut p = Pickler::new(BufWriter::with_capacity(1 << 20, f));
    p.proto().map_err(io_err)?;
    p.empty_dict().map_err(io_err)?;
    p.mark().map_err(io_err)?;
    p.str("device_traces").map_err(io_err)?;
    p.empty_list().map_err(io_err)?;
    p.mark().map_err(io_err)?;
    for idx in 0..n {
        p.empty_list().map_err(io_err)?;
        if let Some(s) = slots.iter().enumerate().find(|(k, s)| index_of(*k, s) == idx).map(|(_, s)| s) {
            let mut part = File::open(&s.part).map_err(|e| format!("{}: {e}", s.part.display()))?;
            io::copy(&mut part, &mut p.w).map_err(io_err)?;
        }
    }
    p.appends().map_err(io_err)?;
    p.str("segments").map_err(io_err)?;
    p.empty_list().map_err(io_err)?;
    p.mark().map_err(io_err)?;
    for (k, s) in slots.iter().enumerate() {
        let pid = m.readers[s.proc_idx].header.pid;
        let mut live: Vec<(&u64, &(u64, u16))> = s.live.iter().collect();
        live.sort();
        for (ptr, (size, api)) in live {
            segment(&mut p, index_of(k, s), *ptr, *size, m.names.get(*api), pid).map_err(io_err)?;
        }
    }
    p.appends().map_err(io_err)?;
    p.setitems().map_err(io_err)?;
    p.stop().map_err(io_err)?;
    p.w.flush().map_err(io_err)?;
    if !single {
        eprintln!("vramcap: memory-viz device lists (one per process and device):");
        for (k, s) in slots.iter().enumerate() {
            let h = &m.readers[s.proc_idx].header;
            eprintln!("  {k}: pid {} ({}) GPU {}", h.pid, h.exe, s.dev);
        }
    }
    eprintln!("vramcap: wrote {}", super::output::shown(out));
    Ok(())
}

fn segment(p: &mut Pickler<impl Write>, device: usize, addr: u64, size: u64, api: &str, pid: u64) -> io::Result<()> {
    p.empty_dict()?;
    p.mark()?;
    p.key_int("device", device as i128)?;
    p.key_int("address", addr as i128)?;
    p.key_int("total_size", size as i128)?;
    p.key_int("allocated_size", size as i128)?;
    p.key_int("active_size", size as i128)?;
    p.key_int("requested_size", size as i128)?;
    p.key_int("stream", 0)?;
    p.key_str("segment_type", "large")?;
    p.str("segment_pool_id")?;
    p.int(0)?;
    p.int(0)?;
    p.tuple2()?;
    p.str("is_expandable")?;
    p.bool(false)?;
    frames(p, api, pid)?;
    p.str("blocks")?;
    p.empty_list()?;
    p.mark()?;
    p.empty_dict()?;
    p.mark()?;
    p.key_int("address", addr as i128)?;
    p.key_int("size", size as i128)?;
    p.key_int("requested_size", size as i128)?;
    p.key_str("state", "active_allocated")?;
    frames(p, api, pid)?;
    p.setitems()?;
    p.appends()?;
    p.setitems()
}
