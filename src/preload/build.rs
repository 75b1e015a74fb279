//! Links GCC's unwinder statically into the preload library instead of depending on
//! `libgcc_s.so.1`: loading that library (and running its constructor) was ~100 µs of every
//! process's start under vramcap (docs/performance.md, "start and exit"). Unwinding is still
//! needed: panics are caught at the C boundary (`catch_unwind`), and that only works with
//! `panic = "unwind"`. The unwinder's symbols stay local to the .so (rustc's version script
//! exports only the hooks), so a process's own libgcc_s is untouched; our panics never leave
//! our frames, so the two unwinders never meet. tests/preload/faults.rs proves a real panic is caught.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // glibc targets only: elsewhere std's own unwinder choice stands.
    if std::env::var("CARGO_CFG_TARGET_ENV").as_deref() != Ok("gnu") || std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    // Whole archive, so every `_Unwind_*` symbol std needs is defined before `-lgcc_s` is
    // reached; `--as-needed` (rustc's default) then drops that dependency. `-bundle`: the
    // archive is found by the C compiler at the final link, not copied into the rlib.
    println!("cargo:rustc-link-lib=static:-bundle,+whole-archive=gcc_eh");
}
