//! The trace file: its lines, lifecycle, loss accounting, placement and ownership.

mod trace;
mod trace_files;
mod trace_loss;
