//! `vramcap demo [--out DIR]`: the whole product on the fake GPU, no GPU needed. A bundled job
//! that behaves like training (cuda-shim/demo/demo_train.c: model load, growing activations, a
//! leak, a burst that hits the cap) runs under an 8 GiB cap with a trace; then the report, the
//! plot and a Perfetto export are written to DIR and we say what to look at.

use super::{clear_vramcap_env, exe_dir, preload_library};
use crate::analysis;
use vramcap_common::grammar::size::human;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Where to write the trace, report and plot.
    #[arg(long, value_name = "DIR", default_value = "vramcap-demo")]
    pub out: PathBuf,
}

const CAP: &str = "8GiB";
const FAKE_LIB: &str = "libcuda.so.1";
const JOB: &str = "demo_train";

/// The source tree this binary was built in (target/<profile>/vramcap → the repository root).
fn source_root(dir: &Path) -> Option<PathBuf> {
    dir.ancestors()
        .take(4)
        .find(|d| d.join("cuda-shim/Makefile").is_file() && d.join("Cargo.toml").is_file())
        .map(Path::to_path_buf)
}

/// The directory with the fake driver and the job: built from the source tree when there is one
/// (make is a no-op when up to date), else what scripts/install.sh put in PREFIX/share/vramcap.
pub(super) fn fake_driver_dir() -> Result<PathBuf, String> {
    let dir = exe_dir()?;
    let installed = dir.join("../share/vramcap/demo");
    let root = source_root(&dir);
    if let Some(root) = &root {
        eprintln!("vramcap: demo: building the fake driver and the demo job (make -C cuda-shim)");
        let st = Command::new("make").arg("-s").arg("-C").arg(root.join("cuda-shim")).status();
        match st {
            Ok(s) if s.success() => {}
            Ok(s) => return Err(format!("make -C {} failed ({s}); it needs a C compiler (gcc) and make", root.join("cuda-shim").display())),
            Err(e) => return Err(format!("cannot run make ({e}); the demo builds the fake driver from cuda-shim/ with make and gcc")),
        }
    }
    let cands: Vec<PathBuf> = root.iter().map(|r| r.join("target/cuda-shim")).chain([installed]).collect();
    cands
        .iter()
        .find(|d| d.join(FAKE_LIB).is_file() && d.join(JOB).is_file())
        .map(|d| d.canonicalize().unwrap_or_else(|_| d.clone()))
        .ok_or_else(|| {
            format!(
                "the demo needs the fake driver ({FAKE_LIB}) and its job ({JOB}); looked in {}. \
                 Build them from the source tree with `make -C cuda-shim` (into target/cuda-shim/), \
                 or install with scripts/install.sh, which copies them to PREFIX/share/vramcap/demo",
                cands.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
            )
        })
}

pub fn main(a: DemoArgs) -> Result<(), String> {
    let t0 = std::time::Instant::now();
    let lib = preload_library()?;
    let fake = fake_driver_dir()?;
    std::fs::create_dir_all(&a.out).map_err(|e| format!("--out {}: cannot create it: {e}", a.out.display()))?;
    let out = a.out.canonicalize().map_err(|e| format!("--out {}: {e}", a.out.display()))?;
    let trace = out.join("trace.jsonl");
    let (svg, report_txt, chrome) = (out.join("usage.svg"), out.join("report.txt"), out.join("trace.chrome.json"));
    for f in [&trace, &svg, &report_txt, &chrome] {
        let _ = std::fs::remove_file(f);
    }
    let shown = a.out.display();
    println!("fake GPU: 1 device, 16 GiB ({}; device memory simulated on the host)", fake.join(FAKE_LIB).display());
    println!("the job:  a training loop reaching the driver the way the CUDA runtime does (cuGetProcAddress_v2)");
    // Runnable as printed: this binary, and the bundled fake GPU under the job (`--fake-gpu`).
    let me = std::env::current_exe().map(|p| p.display().to_string()).unwrap_or_else(|_| "vramcap".into());
    println!("running:  {me} run --fake-gpu 16GiB --limit {CAP} --trace {shown}/trace.jsonl -- {}\n", fake.join(JOB).display());

    let mut cmd = Command::new(fake.join(JOB));
    clear_vramcap_env(&mut cmd);
    let ld_path = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(p) if !p.is_empty() => {
            let mut s = fake.clone().into_os_string();
            s.push(":");
            s.push(p);
            s
        }
        _ => fake.clone().into_os_string(),
    };
    cmd.env("LD_PRELOAD", &lib)
        .env("LD_LIBRARY_PATH", ld_path)
        // Our own dlopen of the driver must get the fake even where a real driver is installed.
        .env("VRAMCAP_REAL_LIBCUDA", fake.join(FAKE_LIB))
        .env("FAKECUDA_DEVICE_COUNT", "1")
        .env("VRAMCAP_LIMIT", CAP)
        .env("VRAMCAP_TRACE", &trace);
    let st = cmd.status().map_err(|e| format!("cannot start {}: {e}", fake.join(JOB).display()))?;
    if !st.success() {
        return Err(format!("the demo job failed ({st}); its messages are above"));
    }

    let files = vec![trace.clone()];
    let r = analysis::report::compute(&files)?;
    r.merged.warn_input();
    let text = analysis::report::to_text(&r);
    std::fs::write(&report_txt, &text).map_err(|e| format!("{}: {e}", report_txt.display()))?;
    println!("\n== the report (vramcap report {shown}/trace.jsonl)\n{text}");
    analysis::plot::plot(&files, &svg)?;
    analysis::export::chrome(&files, &chrome, analysis::export::Window { from: 0, to: u64::MAX })?;

    let j = analysis::report::to_json(&r);
    let d = &j["processes"][0]["devices"][0];
    let gb = |v: &serde_json::Value| human(v.as_u64().unwrap_or(0));
    let secs = |v: &serde_json::Value| v.as_u64().unwrap_or(0) as f64 / 1e9;
    println!("\n== what to look at");
    println!("  the cap      cuMemGetInfo told the job its device has {} (the fake GPU has 16 GiB)", gb(&d["limit"]));
    if let Some(x) = d["denials"].get(0) {
        println!(
            "  the denial   at t={:.3}s a {} activation was refused while {} was in use: the job got\n               \
             CUDA_ERROR_OUT_OF_MEMORY (PyTorch: torch.cuda.OutOfMemoryError) and the GPU stayed within the cap",
            secs(&x["t_ns"]), gb(&x["size"]), gb(&x["used"])
        );
    }
    println!("  the peak     {} at t={:.3}s", gb(&d["peak"]), secs(&d["peak_t_ns"]));
    println!(
        "  the leak     {} in {} allocation(s) still held at exit (\"held at end\"; the largest are listed)",
        gb(&d["leaked_bytes"]),
        d["leaked_count"]
    );
    println!("\n== files in {shown}/");
    println!("  trace.jsonl        every allocation, free and denial, one JSON line each (docs/trace-format.md)");
    println!("  report.txt         the report above");
    println!("  usage.svg          memory over time: model load, optimizer state, the saw tooth of activations,");
    println!("                     the red cap line and the denial marked x; open it in a browser");
    println!("  trace.chrome.json  the same as a timeline for https://ui.perfetto.dev");
    println!("\nOn a real GPU: vramcap run --limit 20GiB --trace job-%p.jsonl --report -- python train.py");
    eprintln!("vramcap: demo: done in {:.1}s", t0.elapsed().as_secs_f64());
    Ok(())
}
