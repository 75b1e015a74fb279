//! The `vramcap` command line. It never links the preload library's hooks: it shares only the
//! pure modules (size grammar, limit parsing) by path; the offline analysis lives in `analysis`.

#[allow(dead_code)]
#[path = "config/size.rs"]
mod size;

mod analysis;
mod cli;
mod sidecar;

use analysis::merge::parse_duration;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "vramcap", version, about = "GPU memory caps, traces and live events for CUDA jobs")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    /// Trace Event JSON for Perfetto UI / chrome://tracing.
    Chrome,
    /// A pickle in PyTorch's memory snapshot layout (pytorch.org/memory_viz).
    MemoryViz,
    /// One row per event, columns named as in the trace.
    Csv,
}

#[derive(Subcommand)]
enum Cmd {
    /// Parse a size the way VRAMCAP_LIMIT does and print it in bytes.
    Size { spec: String },
    /// Collect live events from every preloaded process on the node (VRAMCAP_SIDECAR=PATH) and
    /// serve Prometheus metrics. Protocol: docs/sidecar-protocol.md.
    Sidecar {
        /// Unix socket to listen on (created with mode 0660; its directory is created if missing).
        #[arg(long)]
        socket: std::path::PathBuf,
        /// Serve /metrics on HOST:PORT (port 0 picks a free port, printed at start).
        #[arg(long, value_name = "HOST:PORT")]
        metrics: Option<String>,
        /// Write each client's records to its own JSON Lines file in this directory.
        #[arg(long, value_name = "DIR")]
        trace_dir: Option<std::path::PathBuf>,
        /// Disconnect (and count) a connection that sends no first line within this many seconds.
        #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
        hello_timeout: f64,
        /// Directory of the clients' group ledgers (their VRAMCAP_GROUP_DIR).
        #[arg(long, value_name = "DIR", default_value = "/dev/shm")]
        group_dir: std::path::PathBuf,
        /// Reclaim the charges of dead group members every this many seconds.
        #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
        reclaim_every: f64,
    },
    /// Live table of the processes a sidecar sees.
    Top {
        /// The sidecar's Unix socket.
        #[arg(long)]
        socket: std::path::PathBuf,
        /// Print one snapshot and exit (for scripts).
        #[arg(long)]
        once: bool,
    },
    /// Peak, leaks, denials, failures, size and lifetime distributions per process and device.
    Report {
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Draw usage over time (SVG): per device, processes stacked, the cap as a line, denials marked.
    Plot {
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        #[arg(short, long, default_value = "usage.svg")]
        output: PathBuf,
    },
    /// Convert traces for other viewers and tools.
    Export {
        #[arg(long, value_enum)]
        format: Format,
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        #[arg(short, long)]
        output: PathBuf,
        /// Start of the window, from the earliest trace start (30s, 1.5s, 250ms, …).
        #[arg(long, value_parser = parse_duration)]
        from: Option<u64>,
        /// End of the window, from the earliest trace start.
        #[arg(long, value_parser = parse_duration)]
        to: Option<u64>,
    },
    /// Replay traces together against a device of a given size: do they fit, and what would?
    Replay {
        /// The device size to test (VRAMCAP_LIMIT grammar: 80GiB, 50%, …).
        #[arg(long)]
        limit: String,
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// Start offsets: one per trace (`0,30s,90s`), or one value for "each next trace starts
        /// this much later". Default: all start together.
        #[arg(long, value_delimiter = ',', value_parser = parse_duration)]
        stagger: Vec<u64>,
        #[arg(long)]
        json: bool,
    },
    /// Run a command under vramcap: sets LD_PRELOAD and the variables, forwards signals, exits with its code.
    Run(cli::run::RunArgs),
    /// The whole product on the built-in fake GPU: a capped training-like job, its trace, report and plot.
    Demo(cli::demo::DemoArgs),
    /// Check this machine: library, driver, devices, limits, interception, sidecar.
    Doctor(cli::doctor::DoctorArgs),
    /// Write a synthetic trace (benchmarks, tests).
    #[command(hide = true)]
    GenTrace {
        #[arg(long, default_value_t = 1_000_000)]
        events: u64,
        #[arg(short, long)]
        output: PathBuf,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 4242)]
        pid: u64,
        #[arg(long, default_value_t = 1)]
        devices: u32,
        /// Per-device cap in bytes (0: none).
        #[arg(long, default_value_t = 64 << 30)]
        limit: u64,
        #[arg(long, default_value_t = 80 << 30)]
        total: u64,
        #[arg(long, default_value_t = 1_764_441_600_000_000_000)]
        start_unix_ns: u64,
    },
}

fn fail(msg: String) -> ! {
    eprintln!("vramcap: {msg}");
    std::process::exit(2);
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Size { spec } => match size::parse_size(&spec) {
            Ok(size::Size::Unlimited) => Ok(println!("0 (no limit)")),
            Ok(size::Size::Bytes(b)) => Ok(println!("{b}")),
            Ok(size::Size::Percent(p)) => Ok(println!("{p}% of the device")),
            Err(e) => Err(format!("invalid size {spec:?}: {e}; expected {}", size::SIZE_FORM)),
        },
        Cmd::Sidecar { socket, metrics, trace_dir, hello_timeout, group_dir, reclaim_every } => {
            if !(hello_timeout.is_finite() && hello_timeout > 0.0 && hello_timeout < 1e6) {
                fail(format!("invalid --hello-timeout {hello_timeout}: expected seconds, greater than 0"));
            }
            if !(reclaim_every.is_finite() && reclaim_every >= 0.05 && reclaim_every < 1e6) {
                fail(format!("invalid --reclaim-every {reclaim_every}: expected seconds, at least 0.05"));
            }
            let opts = sidecar::Options {
                socket,
                metrics,
                trace_dir,
                hello_timeout: std::time::Duration::from_secs_f64(hello_timeout),
                group_dir,
                reclaim_every: std::time::Duration::from_secs_f64(reclaim_every),
            };
            if let Err(e) = sidecar::run(opts) {
                eprintln!("vramcap sidecar: {e}");
                std::process::exit(1);
            }
            Ok(())
        }
        Cmd::Top { socket, once } => {
            if let Err(e) = sidecar::top::run(&socket, once) {
                eprintln!("vramcap top: {e}");
                std::process::exit(1);
            }
            Ok(())
        }
        Cmd::Report { traces, json } => analysis::report::compute(&traces).map(|r| {
            r.merged.warn_input();
            if json {
                println!("{}", analysis::report::to_json(&r));
            } else {
                print!("{}", analysis::report::to_text(&r));
            }
        }),
        Cmd::Plot { traces, output } => analysis::plot::plot(&traces, &output),
        Cmd::Export { format, traces, output, from, to } => {
            let window = analysis::export::Window { from: from.unwrap_or(0), to: to.unwrap_or(u64::MAX) };
            match format {
                Format::Chrome => analysis::export::chrome(&traces, &output, window),
                Format::Csv => analysis::export::csv(&traces, &output, window),
                Format::MemoryViz => analysis::memviz::export(&traces, &output, window),
            }
        }
        // Exit status 0: they fit, 1: they do not, 2: an error (as grep and diff).
        Cmd::Replay { limit, traces, stagger, json } => analysis::replay::run(&limit, &traces, &stagger, json).map(|fits| {
            if !fits {
                std::process::exit(1);
            }
        }),
        Cmd::Run(a) => cli::run::main(a),
        Cmd::Demo(a) => cli::demo::main(a),
        Cmd::Doctor(a) => cli::doctor::main(a),
        Cmd::GenTrace { events, output, seed, pid, devices, limit, total, start_unix_ns } => {
            let o = analysis::synth::GenOpts { events, seed, pid, devices: devices.max(1), limit, total, start_unix_ns };
            analysis::synth::generate(&output, &o)
        }
    };
    if let Err(e) = result {
        fail(e);
    }
}
