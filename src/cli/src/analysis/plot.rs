//! `vramcap plot`: usage over time as an SVG (plotters). One panel per device; in each, the
//! processes' charges stacked (the top edge is the device's combined usage), each process's cap
//! as a red line, a group's budget as a dashed one, denials as red crosses. A cap or budget that
//! changed while the job ran (`limit` events: the ceiling file edited, `vramcap limit`) is drawn
//! as the step function it was; where there was none, no line. Time is in seconds
//! since the earliest trace start. The time axis runs to the end of the last trace (its exit, from
//! the summary) and one more step shows each process's state at its end, so memory still held at
//! exit stays visible even when the peak shares the last bucket. The legend sits beside the
//! chart, never on the data.
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
    /// Per bucket: (max usage, usage after its last event); `None` = no event in that bucket.
    /// Empty buckets carry the usage at the end of the last busy one, not its max: a peak that
    /// came and went inside one bucket must not be drawn as lasting.
    vals: Vec<Option<(u64, u64)>>,
}

struct Grid {
    width: u64,
    series: Vec<Series>,
    /// Denials: (time, series).
    marks: Vec<(u64, usize)>,
    dropped_marks: u64,
    /// Limit changes: (time, process, device, the group's budget (else the process's cap), new
    /// limit, 0 = none). Bounded like the marks.
    limits: Vec<LimitStep>,
}

#[derive(Clone, Copy)]
struct LimitStep {
    t: u64,
    proc_idx: usize,
    dev: i32,
    group: bool,
    new: u64,
}

impl Grid {
    fn coarsen(&mut self) {
        self.width *= 2;
        for s in &mut self.series {
            s.vals = s
                .vals
                .chunks(2)
                .map(|c| {
                    let max = c.iter().flatten().map(|v| v.0).max()?;
                    Some((max, c.iter().flatten().last()?.1))
                })
                .collect();
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
        let m = s.vals[b].map_or(0, |v| v.0).max(after).max(if first { before } else { 0 });
        s.vals[b] = Some((m, after));
    }

    /// Usage of series k per bucket for `n` buckets: a busy bucket's max, an empty bucket the
    /// usage the last busy one ended with.
    fn filled(&self, k: usize, n: usize) -> Vec<u64> {
        let mut last = 0;
        (0..n)
            .map(|b| match self.series[k].vals.get(b) {
                Some(Some((max, end))) => {
                    last = *end;
                    *max
                }
                _ => last,
            })
            .collect()
    }
}

fn clean(s: &str) -> String {
    s.chars().map(|c| if matches!(c, '<' | '>' | '&' | '"' | '\'') { '_' } else { c }).collect()
}

pub fn plot(paths: &[PathBuf], out: &Path) -> Result<(), String> {
    let mut m = Merged::open(paths, Align::WallClock)?;
    let mut g = Grid { width: 1000, series: Vec::new(), marks: Vec::new(), dropped_marks: 0, limits: Vec::new() };
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
        if e.op == Op::Limit && g.limits.len() < MAX_MARKS {
            let group = m.names.get(e.api) == "group";
            g.limits.push(LimitStep { t, proc_idx: i, dev: e.dev, group, new: e.size });
        }
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
    // Each trace's end: its exit from the summary when it has one.
    for (i, r) in m.readers.iter().enumerate() {
        if let Some(t) = r.summary.as_ref().and_then(|s| s.t_ns) {
            last_t = last_t.max(m.base[i].saturating_add(t));
        }
    }
    // The summary's charge at exit is the truth; events alone end elsewhere when some were dropped
    // (a false leak, or a leak hidden). The last step goes to the summary's figure at the end.
    for k in 0..g.series.len() {
        let (i, dev, used) = (g.series[k].proc_idx, g.series[k].dev, g.series[k].used);
        let Some(s) = m.readers[i].summary.as_ref() else { continue };
        if let Some(exit) = s.used_at_exit(dev).filter(|&u| u != used) {
            let t = s.t_ns.map_or(last_t, |t| m.base[i].saturating_add(t));
            g.record(k, t, used, exit);
            g.series[k].used = exit;
        }
    }
    // Drawn into memory, then written: a failure to write names the output and the OS's reason
    // (plotters' own "Drawing backend error: Is a directory" said neither what nor where).
    let mut svg = String::new();
    draw(&m, &g, last_t, &mut svg).map_err(|e| format!("cannot draw the plot: {e}"))?;
    {
        use std::io::Write as _;
        let mut f = super::output::create(out).map_err(|e| format!("cannot write the plot: {e}"))?;
        f.write_all(svg.as_bytes()).and_then(|_| f.flush()).map_err(|e| format!("cannot write the plot: {}: {e}", super::output::shown(out)))?;
    }
    if g.dropped_marks > 0 {
        eprintln!("vramcap: {} more denials not marked (the plot marks the first {MAX_MARKS})", g.dropped_marks);
    }
    eprintln!("vramcap: wrote {}", super::output::shown(out));
    Ok(())
}

fn draw(m: &Merged, g: &Grid, last_t: u64, out: &mut String) -> Result<(), Box<dyn std::error::Error>> {
    let mut devs: Vec<i32> = g.series.iter().map(|s| s.dev).collect();
    devs.sort();
    devs.dedup();
    let panels = devs.len().max(1);
    let root = SVGBackend::with_string(out, (1200, 60 + 340 * panels as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = if m.readers.len() == 1 {
        let h = &m.readers[0].header;
        format!("GPU memory: {} (pid {}) on {}", clean(&h.exe), h.pid, clean(&h.host))
    } else {
        format!("GPU memory: {} processes", m.readers.len())
    };
    let root = root.titled(&title, ("sans-serif", 22))?;
    let areas = root.split_evenly((panels, 1));
    // One step past the last trace's end: there every series holds its value at its end.
    let end_bucket = (last_t / g.width) as usize + 1;
    let n = end_bucket + (end_bucket / 40).max(1);
    let unit_ns = 1e9;
    let secs = |b: usize| (b as u64 * g.width) as f64 / unit_ns;
    let xmax = secs(n).max(1e-9);
    for (area, &dev) in areas.iter().zip(devs.iter()) {
        let (area, legend_area) = area.split_horizontally(area.dim_in_pixel().0.saturating_sub(LEGEND_WIDTH));
        let mut legend: Vec<(String, Swatch)> = Vec::new();
        let ks: Vec<usize> = (0..g.series.len()).filter(|&k| g.series[k].dev == dev).collect();
        // Stack: cumulative sums in series order.
        let mut stacked: Vec<Vec<u64>> = Vec::new();
        for &k in &ks {
            let v = g.filled(k, n);
            let base = stacked.last().cloned().unwrap_or_else(|| vec![0; n]);
            stacked.push(v.iter().zip(base.iter()).map(|(a, b)| a + b).collect());
        }
        // Each process's cap from its header, then its own changes; the group's budget from the
        // first member's header, then every member's record of its changes (in time order).
        let header_dev = |k: usize| m.readers[g.series[k].proc_idx].header.devices.iter().find(|d| d.index == dev);
        let mut caps: Vec<(usize, Vec<(u64, u64)>)> = ks
            .iter()
            .map(|&k| {
                let p = g.series[k].proc_idx;
                let changes = g.limits.iter().filter(|l| !l.group && l.proc_idx == p && l.dev == dev).map(|l| (l.t, l.new));
                (k, std::iter::once((0, header_dev(k).and_then(|d| d.limit).unwrap_or(0))).chain(changes).collect::<Vec<_>>())
            })
            .filter(|(_, st)| st.iter().any(|s| s.1 > 0))
            .collect();
        caps.dedup_by(|a, b| a.1 == b.1);
        let group_cap: Option<Vec<(u64, u64)>> = {
            let first = ks.iter().find_map(|&k| header_dev(k).and_then(|d| d.group_limit));
            let mut changes: Vec<(u64, u64)> = g.limits.iter().filter(|l| l.group && l.dev == dev && ks.iter().any(|&k| g.series[k].proc_idx == l.proc_idx)).map(|l| (l.t, l.new)).collect();
            changes.sort();
            let mut st = vec![(0, first.unwrap_or(0))];
            for c in changes {
                if st.last().is_some_and(|l| l.1 != c.1) {
                    st.push(c);
                }
            }
            st.iter().any(|s| s.1 > 0).then_some(st)
        };
        let top = stacked.last().and_then(|v| v.iter().max().copied()).unwrap_or(0);
        let cap_max = caps.iter().flat_map(|c| c.1.iter()).chain(group_cap.iter().flatten()).map(|s| s.1).max().unwrap_or(0);
        let ymax = (top.max(cap_max) as f64 / GIB * 1.1).max(1e-3);
        let mut chart = ChartBuilder::on(&area)
            .caption(format!("GPU {dev}"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..xmax, 0f64..ymax)?;
        chart
            .configure_mesh()
            .x_desc("seconds since the first trace start")
            .y_desc("GiB charged")
            .x_label_formatter(&|v| tick(*v))
            .y_label_formatter(&|v| tick(*v))
            .draw()?;
        // Draw the tallest layer first so each lower layer paints over it.
        for (j, &k) in ks.iter().enumerate().rev() {
            let c = Palette99::pick(g.series[k].proc_idx).to_rgba();
            let color = RGBColor(c.0, c.1, c.2);
            // Opaque: a translucent layer over the one below blends into a colour the legend
            // does not have. The legend's swatch is this very fill.
            let fill = lighter(color);
            let h = &m.readers[g.series[k].proc_idx].header;
            // Steps, not slopes: each bucket holds its value for its whole width.
            let pts: Vec<(f64, f64)> = stacked[j].iter().enumerate().flat_map(|(b, v)| [(secs(b), *v as f64 / GIB), (secs(b + 1), *v as f64 / GIB)]).collect();
            chart.draw_series(AreaSeries::new(pts, 0.0, fill.filled()).border_style(color.stroke_width(1)))?;
            let s = &g.series[k];
            let dropped = m.readers[g.series[k].proc_idx].summary.as_ref().map_or(0, |s| s.dropped);
            let note = if dropped > 0 { format!(" ({dropped} event(s) dropped)") } else { String::new() };
            legend.push((format!("pid {} ({}): {} at end{note}", h.pid, clean(&h.exe), vramcap_common::grammar::size::human(s.used)), Swatch::Area(fill, color)));
        }
        if let Some(st) = &group_cap {
            for seg in step_segments(st, xmax) {
                chart.draw_series(DashedLineSeries::new(seg, 8, 4, RED.stroke_width(2)))?;
            }
            let name = ks.iter().find_map(|&k| m.readers[g.series[k].proc_idx].header.group.clone()).unwrap_or_default();
            legend.push((format!("group \"{}\" budget {}", clean(&name), step_label(st)), Swatch::Dashed(RED)));
        }
        for (k, st) in &caps {
            let label = if caps.len() == 1 { "cap".to_string() } else { format!("cap pid {}", m.readers[g.series[*k].proc_idx].header.pid) };
            for seg in step_segments(st, xmax) {
                chart.draw_series(LineSeries::new(seg, RED.stroke_width(2)))?;
            }
            legend.push((format!("{label} {}", step_label(st)), Swatch::Line(RED)));
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
            chart.draw_series(marks.into_iter().map(|p| Cross::new(p, 5, RED.stroke_width(2))))?;
            legend.push(("denied".into(), Swatch::Cross(RED)));
        }
        if let Some(end) = stacked.last().map(|v| v[n - 1]) {
            // A total, not a thing drawn: no swatch.
            legend.push((format!("all: {} held at the end", vramcap_common::grammar::size::human(end)), Swatch::None));
        }
        draw_legend(&legend_area, &legend)?;
    }
    root.present()?;
    Ok(())
}

const LEGEND_WIDTH: u32 = 300;

/// What a legend row shows beside its label: exactly what the chart draws for it.
enum Swatch {
    /// A process's stacked area: its fill and its border.
    Area(RGBColor, RGBColor),
    /// A cap: a solid line.
    Line(RGBColor),
    /// A group budget: a dashed line.
    Dashed(RGBColor),
    /// A denial: the chart's ×.
    Cross(RGBColor),
    /// A figure with nothing drawn for it.
    None,
}

/// `c` at 45 % over white, opaque (what `c.mix(0.45)` looks like on the white background).
fn lighter(c: RGBColor) -> RGBColor {
    let f = |v: u8| (v as f64 * 0.45 + 255.0 * 0.55).round() as u8;
    RGBColor(f(c.0), f(c.1), f(c.2))
}

/// A limit over time, `(t_ns, bytes)` from t = 0 (0 = none), as the line segments of its steps
/// in the chart's units: level while it holds, vertical where it changes, nothing while none.
fn step_segments(steps: &[(u64, u64)], xmax: f64) -> Vec<Vec<(f64, f64)>> {
    let mut out: Vec<Vec<(f64, f64)>> = Vec::new();
    let mut cur: Vec<(f64, f64)> = Vec::new();
    for (n, &(t, v)) in steps.iter().enumerate() {
        let x = (t as f64 / 1e9).min(xmax);
        let end = steps.get(n + 1).map_or(xmax, |s| (s.0 as f64 / 1e9).min(xmax));
        if v == 0 {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            continue;
        }
        let y = v as f64 / GIB;
        cur.push((x, y));
        cur.push((end, y));
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// `1.0 GiB`, or for a limit that changed `1.0 GiB -> 256.0 MiB (2 changes)`.
fn step_label(steps: &[(u64, u64)]) -> String {
    let show = |b: u64| if b == 0 { "none".to_string() } else { vramcap_common::grammar::size::human(b) };
    match steps {
        [(_, v)] => show(*v),
        [first, .., last] => format!("{} -> {} ({} change{})", show(first.1), show(last.1), steps.len() - 1, if steps.len() == 2 { "" } else { "s" }),
        [] => String::new(),
    }
}

/// The legend, in its own column to the right of the chart: a swatch and a label per row.
fn draw_legend<DB: DrawingBackend>(area: &DrawingArea<DB, plotters::coord::Shift>, items: &[(String, Swatch)]) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    for (i, (label, swatch)) in items.iter().enumerate() {
        let y = 50 + 22 * i as i32;
        match swatch {
            Swatch::Area(fill, border) => {
                area.draw(&Rectangle::new([(8, y - 6), (24, y + 6)], fill.filled()))?;
                area.draw(&Rectangle::new([(8, y - 6), (24, y + 6)], border.stroke_width(1)))?;
            }
            Swatch::Line(c) => area.draw(&PathElement::new(vec![(8, y), (24, y)], c.stroke_width(2)))?,
            Swatch::Dashed(c) => {
                area.draw(&PathElement::new(vec![(8, y), (14, y)], c.stroke_width(2)))?;
                area.draw(&PathElement::new(vec![(18, y), (24, y)], c.stroke_width(2)))?;
            }
            Swatch::Cross(c) => area.draw(&Cross::new((16, y), 5, c.stroke_width(2)))?,
            Swatch::None => {}
        }
        area.draw(&Text::new(label.clone(), (32, y - 7), ("sans-serif", 13)))?;
    }
    Ok(())
}

/// A tick label without needless decimals: 0, 0.5, 1.25, 2 (at most 6 significant decimals).
fn tick(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let s = format!("{v:.6}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peak_inside_one_bucket_is_not_carried_forward() {
        let mut g = Grid { width: 10, series: Vec::new(), marks: Vec::new(), dropped_marks: 0, limits: Vec::new() };
        g.series.push(Series { proc_idx: 0, dev: 0, used: 0, vals: Vec::new() });
        g.record(0, 1, 0, 100); // bucket 0: up to 100 ...
        g.record(0, 5, 100, 20); // ... and back to 20
        g.record(0, 35, 20, 30); // bucket 3
        assert_eq!(g.filled(0, 5), vec![100, 20, 20, 30, 30]);
        g.coarsen(); // [0,1] [2,3] [4]
        assert_eq!(g.filled(0, 3), vec![100, 30, 30]);
    }

    #[test]
    fn a_limit_that_changed_is_drawn_as_steps_and_none_as_no_line() {
        let gib = 1u64 << 30;
        let st = [(0, gib), (2_000_000_000, gib / 4), (3_000_000_000, 0), (4_000_000_000, 2 * gib)];
        assert_eq!(
            step_segments(&st, 5.0),
            vec![vec![(0.0, 1.0), (2.0, 1.0), (2.0, 0.25), (3.0, 0.25)], vec![(4.0, 2.0), (5.0, 2.0)]]
        );
        assert_eq!(step_label(&st), "1.0 GiB -> 2.0 GiB (3 changes)");
        assert_eq!(step_label(&st[..1]), "1.0 GiB");
    }

    #[test]
    fn tick_labels_have_no_needless_decimals() {
        assert_eq!([tick(0.0), tick(0.5), tick(2.0), tick(1.25), tick(0.000123)], ["0", "0.5", "2", "1.25", "0.000123"]);
    }
}
