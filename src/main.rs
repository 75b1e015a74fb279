//! The `vramcap` command line. It never links the preload library's hooks: it shares only the
//! pure modules (size grammar, limit parsing) by path.

#[allow(dead_code)]
#[path = "config/size.rs"]
mod size;

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
    }
}
