//! `vramcap plot`: usage over time as an SVG (plotters). One panel per device; in each, the
//! processes' charges stacked (the top edge is the device's combined usage), each process's cap
//! as a red line, denials as red crosses.
//!
//! Streaming: usage is kept on a time grid of at most `MAX_BUCKETS` buckets per series (the max
//! within each bucket, so peaks survive); when the trace outgrows the grid, buckets merge
//! pairwise and the bucket width doubles.

use super::merge::{Align, Merged};
use super::stats::next_used;
use super::trace::Op;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

const MAX_BUCKETS: usize = 2000;
const MAX_MARKS: usize = 5000;
const GIB: f64 = (1u64 << 30) as f64;

struct Series {
    proc_idx: usize,
    dev: i32,
    used: u64,
    /// Max usage per bucket; `None` = no event in that bucket (usage carried forward).
    vals: Vec<Option<u64>>,
}

struct Grid {
    width: u64,
    series: Vec<Series>,
    /// Denials: (time, series).
    marks: Vec<(u64, usize)>,
    dropped_marks: u64,
}

impl Grid {
    fn coarsen(&mut self) {
        self.width *= 2;
        for s in &mut self.series {
            s.vals = s.vals.chunks(2).map(|c| c.iter().flatten().copied().max()).collect();
        }
    }

    fn record(&mut self, k: usize, t: u64, before: u64, after: u64) {
        while (t / self.width) as usize >= MAX_BUCKETS {
            self.coarsen();
        }
        let b = (t / self.width) as usize;
        let s = &mut self.series[k];
        if s.vals.len() <= b {
            s.vals.resize(b + 1, None);
        }
        // The bucket also saw the usage before this event (from its start until now).
        let first = s.vals[b].is_none();
        let m = s.vals[b].unwrap_or(0).max(after).max(if first { before } else { 0 });
        s.vals[b] = Some(m);
    }

    /// Usage of series k per bucket for `n` buckets, carried forward through empty buckets.
    fn filled(&self, k: usize, n: usize) -> Vec<u64> {
        let mut last = 0;
        (0..n)
            .map(|b| {
                if let Some(Some(v)) = self.series[k].vals.get(b) {
                    last = *v;
                }
                last
            })
            .collect()
    }
}

fn clean(s: &str) -> String {
    s.chars().map(|c| if matches!(c, '<' | '>' | '&' | '"' | '\'') { '_' } else { c }).collect()
}

pub fn plot(paths: &[PathBuf], out: &Path) -> Result<(), String> {
    let mut m = Merged::open(paths, Align::WallClock)?;
    let mut g = Grid { width: 1000, series: Vec::new(), marks: Vec::new(), dropped_marks: 0 };
    let mut last_t = 0;
    while let Some((i, e, t)) = m.next() {
        if e.dev < 0 {
            continue;
        }
        last_t = last_t.max(t);
        let k = match g.series.iter().position(|s| s.proc_idx == i && s.dev == e.dev) {
            Some(k) => k,
            None => {
                g.series.push(Series { proc_idx: i, dev: e.dev, used: 0, vals: Vec::new() });
                g.series.len() - 1
            }
        };
        let before = g.series[k].used;
        let after = next_used(before, &e);
        g.series[k].used = after;
        g.record(k, t, before, after);
        if e.op == Op::Deny {
            if g.marks.len() < MAX_MARKS {
                g.marks.push((t, k));
            } else {
                g.dropped_marks += 1;
            }
        }
    }
    m.finish_progress();
    m.warn_input();
    draw(&m, &g, last_t, out).map_err(|e| format!("{}: cannot draw: {e}", out.display()))?;
    if g.dropped_marks > 0 {
        eprintln!("vramcap: {} more denials not marked (the plot marks the first {MAX_MARKS})", g.dropped_marks);
    }
    eprintln!("vramcap: wrote {}", out.display());
    Ok(())
}

fn draw(m: &Merged, g: &Grid, last_t: u64, out: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let mut devs: Vec<i32> = g.series.iter().map(|s| s.dev).collect();
    devs.sort();
    devs.dedup();
    let panels = devs.len().max(1);
    let root = SVGBackend::new(out, (1200, 60 + 340 * panels as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = if m.readers.len() == 1 {
        let h = &m.readers[0].header;
        format!("GPU memory: {} (pid {}) on {}", clean(&h.exe), h.pid, clean(&h.host))
    } else {
        format!("GPU memory: {} processes", m.readers.len())
    };
    let root = root.titled(&title, ("sans-serif", 22))?;
    let areas = root.split_evenly((panels, 1));
    let n = (last_t / g.width) as usize + 1;
    // Axis unit chosen so tick labels stay distinct for short traces too.
    let span_ns = n as u64 * g.width;
    let (unit_ns, unit) = match span_ns {
        s if s < 10_000 => (1.0, "ns"),
        s if s < 10_000_000 => (1e3, "us"),
        s if s < 10_000_000_000 => (1e6, "ms"),
        _ => (1e9, "s"),
    };
    let secs = |b: usize| (b as u64 * g.width) as f64 / unit_ns;
    let xmax = secs(n).max(1e-6);
    for (area, &dev) in areas.iter().zip(devs.iter()) {
        let ks: Vec<usize> = (0..g.series.len()).filter(|&k| g.series[k].dev == dev).collect();
        // Stack: cumulative sums in series order.
        let mut stacked: Vec<Vec<u64>> = Vec::new();
        for &k in &ks {
            let v = g.filled(k, n);
            let base = stacked.last().cloned().unwrap_or_else(|| vec![0; n]);
            stacked.push(v.iter().zip(base.iter()).map(|(a, b)| a + b).collect());
        }
        let caps: Vec<(usize, u64)> = ks
            .iter()
            .filter_map(|&k| {
                let h = &m.readers[g.series[k].proc_idx].header;
                h.devices.iter().find(|d| d.index == dev).and_then(|d| d.limit).map(|l| (k, l))
            })
            .collect();
        let top = stacked.last().and_then(|v| v.iter().max().copied()).unwrap_or(0);
        let cap_max = caps.iter().map(|c| c.1).max().unwrap_or(0);
        let ymax = (top.max(cap_max) as f64 / GIB * 1.1).max(1e-3);
        let mut chart = ChartBuilder::on(area)
            .caption(format!("GPU {dev}"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..xmax, 0f64..ymax)?;
        chart.configure_mesh().x_desc(format!("{unit} since the first trace start")).y_desc("GiB charged").draw()?;
        // Draw the tallest layer first so each lower layer paints over it.
        for (j, &k) in ks.iter().enumerate().rev() {
            let color = Palette99::pick(g.series[k].proc_idx);
            let h = &m.readers[g.series[k].proc_idx].header;
            // Steps, not slopes: each bucket holds its value for its whole width.
            let pts: Vec<(f64, f64)> = stacked[j].iter().enumerate().flat_map(|(b, v)| [(secs(b), *v as f64 / GIB), (secs(b + 1), *v as f64 / GIB)]).collect();
            chart
                .draw_series(AreaSeries::new(pts, 0.0, color.mix(0.45)).border_style(color.stroke_width(1)))?
                .label(format!("pid {} ({})", h.pid, clean(&h.exe)))
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        }
        let mut same = caps.clone();
        same.dedup_by_key(|c| c.1);
        for (k, cap) in &same {
            let y = *cap as f64 / GIB;
            let label = if same.len() == 1 { "cap".to_string() } else { format!("cap pid {}", m.readers[g.series[*k].proc_idx].header.pid) };
            chart
                .draw_series(LineSeries::new(vec![(0.0, y), (xmax, y)], RED.stroke_width(2)))?
                .label(label)
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 12, y)], RED.stroke_width(2)));
        }
        let marks: Vec<(f64, f64)> = g
            .marks
            .iter()
            .filter_map(|&(t, k)| {
                let j = ks.iter().position(|&x| x == k)?;
                let b = ((t / g.width) as usize).min(n - 1);
                Some((t as f64 / unit_ns, stacked[j][b] as f64 / GIB))
            })
            .collect();
        if !marks.is_empty() {
            chart
                .draw_series(marks.into_iter().map(|p| Cross::new(p, 5, RED.stroke_width(2))))?
                .label("denied")
                .legend(|(x, y)| Cross::new((x + 6, y), 4, RED.stroke_width(2)));
        }
        chart.configure_series_labels().position(SeriesLabelPosition::UpperLeft).background_style(WHITE.mix(0.85)).border_style(BLACK).draw()?;
    }
    root.present()?;
    Ok(())
}
