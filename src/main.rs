//! The `vramcap` command line. It never links the preload library's hooks: it shares only the
//! pure modules (size grammar, limit parsing) by path.

#[allow(dead_code)]
#[path = "config/size.rs"]
mod size;

mod sidecar;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "vramcap", version, about = "GPU memory caps, traces and live events for CUDA jobs")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
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
}

fn main() {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Size { spec } => match size::parse_size(&spec) {
            Ok(size::Size::Unlimited) => println!("0 (no limit)"),
            Ok(size::Size::Bytes(b)) => println!("{b}"),
            Ok(size::Size::Percent(p)) => println!("{p}% of the device"),
            Err(e) => {
                eprintln!("vramcap: invalid size {spec:?}: {e}; expected {}", size::SIZE_FORM);
                std::process::exit(2);
            }
        },
        Cmd::Sidecar { socket, metrics, trace_dir, hello_timeout } => {
            if !(hello_timeout.is_finite() && hello_timeout > 0.0 && hello_timeout < 1e6) {
                eprintln!("vramcap: invalid --hello-timeout {hello_timeout}: expected seconds, greater than 0");
                std::process::exit(2);
            }
            let opts = sidecar::Options { socket, metrics, trace_dir, hello_timeout: std::time::Duration::from_secs_f64(hello_timeout) };
            if let Err(e) = sidecar::run(opts) {
                eprintln!("vramcap sidecar: {e}");
                std::process::exit(1);
            }
        }
        Cmd::Top { socket, once } => {
            if let Err(e) = sidecar::top::run(&socket, once) {
                eprintln!("vramcap top: {e}");
                std::process::exit(1);
            }
        }
    }
}
