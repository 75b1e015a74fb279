//! The `vramcap` command line: the subcommands and their flags, over the `vramcap_cli` library (lib.rs).

use vramcap_cli::{analysis, cdi, cli, sidecar};
use vramcap_common::grammar::{self, size};

use analysis::merge::parse_duration;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// The sidecar's socket as docs/deploy.md places it (`sidecar` and `top` default to it).
const DEFAULT_SOCKET: &str = "/run/vramcap/sidecar.sock";

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
    /// Parse a limit the way VRAMCAP_LIMIT does and print it in bytes (one line per device entry).
    Size {
        /// A size (8GiB, 50%, 0 = no limit) or a per-device list (0=8GiB,1=4GiB, GPU-8932f937=2g).
        spec: String,
    },
    /// Collect live events from every preloaded process on the node (VRAMCAP_SIDECAR=PATH) and
    /// serve Prometheus metrics. Protocol: docs/sidecar-protocol.md.
    Sidecar {
        /// Unix socket to listen on (created with mode 0660; its directory is created if missing).
        #[arg(long, default_value = DEFAULT_SOCKET)]
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
        /// Directory of the clients' group ledgers (their VRAMCAP_GROUP_DIR). Without it, each
        /// client's groups are swept in the members' default, /dev/shm/vramcap-<the client's uid>.
        #[arg(long, value_name = "DIR")]
        group_dir: Option<std::path::PathBuf>,
        /// Reclaim the charges of dead group members every this many seconds.
        #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
        reclaim_every: f64,
        /// Disconnect a client that sends nothing for this many seconds (live ones send a usage
        /// snapshot every second).
        #[arg(long, value_name = "SECONDS", default_value_t = 60.0)]
        idle_timeout: f64,
        /// Connections one uid may hold at once (of 4096 in all); more are closed at once.
        #[arg(long, value_name = "N", default_value_t = 512)]
        max_connections_per_uid: usize,
        /// Numeric gid whose members (like root) see every process in `vramcap top`; everyone
        /// else sees only the processes of their own uid.
        #[arg(long, value_name = "GID")]
        admin_group: Option<u32>,
    },
    /// Live table of the processes a sidecar sees.
    Top {
        /// The sidecar's Unix socket.
        #[arg(long, default_value = DEFAULT_SOCKET)]
        socket: std::path::PathBuf,
        /// Print one snapshot and exit (for scripts).
        #[arg(long)]
        once: bool,
        /// With --once: wait up to this many seconds for the sidecar to answer and a first
        /// process to be connected before printing (a sidecar or job just started).
        #[arg(long, value_name = "SECONDS", requires = "once")]
        wait: Option<f64>,
    },
    /// Peak, leaks, denials, failures, size and lifetime distributions per process and device.
    Report {
        /// Trace files (VRAMCAP_TRACE output); several are merged on the wall clock, and one that
        /// cannot be read is skipped with a line on stderr.
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Write the report to this file instead of standard output (`-`: standard output).
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Draw usage over time (SVG): per device, processes stacked, the cap as a line, denials marked.
    Plot {
        /// Trace files (VRAMCAP_TRACE output), merged on the wall clock.
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// The SVG file to write (`-`: standard output).
        #[arg(short, long, default_value = "usage.svg")]
        output: PathBuf,
    },
    /// Convert traces for other viewers and tools.
    Export {
        /// The output format.
        #[arg(long, value_enum)]
        format: Format,
        /// Trace files (VRAMCAP_TRACE output), merged on the wall clock.
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// The file to write (`-`: standard output).
        #[arg(short, long)]
        output: PathBuf,
        /// Start of the window, from the earliest trace start (30s, 1.5s, 250ms, …; at most 10
        /// years). Past the traces' last event it is an error: nothing would be exported.
        #[arg(long, value_parser = parse_duration)]
        from: Option<u64>,
        /// End of the window, from the earliest trace start (same units).
        #[arg(long, value_parser = parse_duration)]
        to: Option<u64>,
    },
    /// Replay traces together against a device of a given size: do they fit, and what would?
    Replay {
        /// The device size to test, in VRAMCAP_LIMIT's grammar: 80GiB, 50%, or per device
        /// 0=80GiB,1=40GiB (ordinal keys; devices not named are uncapped); the traces' own limit
        /// changes are then ignored. Without it, the limits the traces recorded, changes included.
        #[arg(long)]
        limit: Option<String>,
        /// Trace files (VRAMCAP_TRACE output), one per process to place on the device.
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// Start offsets: one per trace (`0,30s,90s`), or one value for "each next trace starts
        /// this much later". Default: all start together. At most 10 years each.
        #[arg(long, value_delimiter = ',', value_parser = parse_duration)]
        stagger: Vec<u64>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// The traces as one vramcap group: how it admits allocations (docs/analysis.md).
        #[arg(long, value_enum, default_value = "shared")]
        policy: analysis::policy::Policy,
        /// A member's priority, TRACE=N (TRACE: the path as given, or its file name; default 0).
        #[arg(long, value_name = "TRACE=N")]
        priority: Vec<String>,
        /// Memory kept for a member from its start, TRACE=SIZE or TRACE=0=2GiB,1=1GiB.
        #[arg(long, value_name = "TRACE=SIZE")]
        reserve: Vec<String>,
        /// Kept free for the next member to start beside running ones: SIZE or 0=2GiB,1=1GiB.
        #[arg(long, value_name = "SIZE")]
        headroom: Option<String>,
    },
    /// Run a command under vramcap: sets LD_PRELOAD and the variables, forwards signals, exits with its code.
    Run(cli::run::RunArgs),
    /// Print or change a running group's budget (members apply it at their next allocation).
    Limit(cli::limit::LimitArgs),
    /// The whole product on the built-in fake GPU: a capped training-like job, its trace, report and plot.
    Demo(cli::demo::DemoArgs),
    /// Check this machine: library, driver, devices, limits, interception, sidecar.
    Doctor(cli::doctor::DoctorArgs),
    /// Write a CDI spec (podman, containerd, Kubernetes) with one device per budget: its
    /// containers' processes share the budget, and nothing inside can raise or remove it.
    Cdi(cdi::spec::CdiArgs),
    /// What the CDI spec's hooks run (the container runtime calls it; docs/deploy.md).
    #[command(hide = true)]
    CdiHook(cdi::hook::HookArgs),
    /// Write a synthetic trace (benchmarks, tests).
    #[command(hide = true)]
    GenTrace {
        /// Events to write.
        #[arg(long, default_value_t = 1_000_000)]
        events: u64,
        /// The trace file to write.
        #[arg(short, long)]
        output: PathBuf,
        /// Seed of the pseudo-random workload (same seed, same trace).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// The pid the header claims.
        #[arg(long, default_value_t = 4242)]
        pid: u64,
        /// Devices the workload spreads over.
        #[arg(long, default_value_t = 1)]
        devices: u32,
        /// Per-device cap in bytes (0: none).
        #[arg(long, default_value_t = 64 << 30)]
        limit: u64,
        /// Per-device physical memory in bytes, as the header claims.
        #[arg(long, default_value_t = 80 << 30)]
        total: u64,
        /// The trace's start time (Unix ns) in the header.
        #[arg(long, default_value_t = 1_764_441_600_000_000_000)]
        start_unix_ns: u64,
    },
}

fn fail(msg: String) -> ! {
    eprintln!("vramcap: {msg}");
    std::process::exit(2);
}

/// `vramcap size SPEC`: exactly the VRAMCAP_LIMIT grammar (the library's parser).
fn print_size(spec: &str) -> Result<(), String> {
    use grammar::limits::{DeviceKey, parse_list};
    use size::Size;
    let entries =
        parse_list("VRAMCAP_LIMIT", spec).map_err(|e| format!("invalid size {spec:?}: {}; expected {}", e.reason, e.expected))?;
    let show = |s: Size| match s {
        Size::Unlimited => "0 (no limit)".to_string(),
        Size::Bytes(b) => b.to_string(),
        Size::Percent(p) => format!("{p}% of the device"),
    };
    for e in &entries {
        match &e.key {
            None => println!("{}", show(e.size)),
            Some(DeviceKey::Ordinal(i)) => println!("device {i}: {}", show(e.size)),
            Some(DeviceKey::Uuid(u)) => println!("GPU-{}: {}", &u[4..], show(e.size)),
        }
    }
    Ok(())
}

/// clap's own errors in the one `vramcap: ` form every other error has (its `error: ` replaced);
/// help and version go out as clap writes them.
fn parse_args() -> Cli {
    use clap::error::ErrorKind;
    match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand) => e.exit(),
        Err(e) => {
            let msg = e.render().to_string();
            eprint!("vramcap: {}", msg.strip_prefix("error: ").unwrap_or(&msg));
            std::process::exit(2);
        }
    }
}

fn main() {
    let cli = parse_args();
    if !matches!(cli.cmd, Cmd::Sidecar { .. } | Cmd::Top { .. } | Cmd::Run(_)) {
        cli::die_on_broken_pipe();
    }
    let result = match cli.cmd {
        Cmd::Size { spec } => print_size(&spec),
        Cmd::Sidecar { socket, metrics, trace_dir, hello_timeout, group_dir, reclaim_every, idle_timeout, max_connections_per_uid, admin_group } => {
            if !(hello_timeout.is_finite() && hello_timeout > 0.0 && hello_timeout < 1e6) {
                fail(format!("invalid --hello-timeout {hello_timeout}: expected seconds, greater than 0"));
            }
            if !(reclaim_every.is_finite() && reclaim_every >= 0.05 && reclaim_every < 1e6) {
                fail(format!("invalid --reclaim-every {reclaim_every}: expected seconds, at least 0.05"));
            }
            if !(idle_timeout.is_finite() && idle_timeout >= 1.0 && idle_timeout < 1e6) {
                fail(format!("invalid --idle-timeout {idle_timeout}: expected seconds, at least 1 (clients report every second)"));
            }
            if max_connections_per_uid == 0 {
                fail("invalid --max-connections-per-uid 0: expected at least 1".to_string());
            }
            let opts = sidecar::Options {
                socket,
                metrics,
                trace_dir,
                hello_timeout: std::time::Duration::from_secs_f64(hello_timeout),
                group_dir,
                reclaim_every: std::time::Duration::from_secs_f64(reclaim_every),
                idle_timeout: std::time::Duration::from_secs_f64(idle_timeout),
                max_per_uid: max_connections_per_uid,
                admin_gid: admin_group,
            };
            if let Err(e) = sidecar::run(opts) {
                eprintln!("vramcap: sidecar: {e}");
                std::process::exit(1);
            }
            Ok(())
        }
        Cmd::Top { socket, once, wait } => {
            let wait = match wait {
                Some(w) if !(w.is_finite() && (0.0..1e6).contains(&w)) => fail(format!("invalid --wait {w}: expected seconds, 0 or more")),
                w => w.map(std::time::Duration::from_secs_f64),
            };
            if let Err(e) = sidecar::top::run(&socket, once, wait) {
                eprintln!("vramcap: top: {e}");
                std::process::exit(1);
            }
            Ok(())
        }
        Cmd::Report { traces, json, output } => analysis::report::compute(&traces).and_then(|r| {
            r.merged.warn_input();
            let text = if json { format!("{}\n", analysis::report::to_json(&r)) } else { analysis::report::to_text(&r) };
            match output {
                Some(p) if !analysis::output::is_stdout(&p) => {
                    use std::io::Write as _;
                    let mut f = analysis::output::create(&p)?;
                    f.write_all(text.as_bytes()).map_err(|e| format!("{}: cannot write: {e}", p.display()))
                }
                _ => {
                    print!("{text}");
                    Ok(())
                }
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
        Cmd::Replay { limit, traces, stagger, json, policy, priority, reserve, headroom } => {
            let o = analysis::replay::Opts {
                limit: limit.as_deref(),
                paths: &traces,
                stagger: &stagger,
                json,
                policy,
                priority: &priority,
                reserve: &reserve,
                headroom: headroom.as_deref(),
            };
            analysis::replay::run(&o).map(|fits| {
                if !fits {
                    std::process::exit(1);
                }
            })
        }
        Cmd::Run(a) => cli::run::main(a),
        Cmd::Limit(a) => cli::limit::main(a),
        Cmd::Demo(a) => cli::demo::main(a),
        Cmd::Doctor(a) => cli::doctor::main(a),
        Cmd::Cdi(a) => cdi::spec::main(a),
        Cmd::CdiHook(a) => cdi::hook::main(a).map_err(|e| format!("cdi-hook: {e}")),
        Cmd::GenTrace { events, output, seed, pid, devices, limit, total, start_unix_ns } => {
            let o = analysis::synth::GenOpts { events, seed, pid, devices: devices.max(1), limit, total, start_unix_ns };
            analysis::synth::generate(&output, &o)
        }
    };
    if let Err(e) = result {
        fail(e);
    }
}
