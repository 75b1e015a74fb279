//! Where `-o` writes: a file, or standard output for `-` (as every Unix tool takes it; a file
//! named `-` is `./-`).

use std::fs::File;
use std::os::fd::AsFd;
use std::path::Path;

pub fn is_stdout(path: &Path) -> bool {
    path.as_os_str() == "-"
}

/// The output for `path`: our standard output (a duplicate of fd 1, so the writer owns a plain
/// `File` either way) for `-`, else the file, created or truncated. The error names the path.
pub fn create(path: &Path) -> Result<File, String> {
    if is_stdout(path) {
        let fd = std::io::stdout().as_fd().try_clone_to_owned().map_err(|e| format!("standard output: {e}"))?;
        return Ok(File::from(fd));
    }
    File::create(path).map_err(|e| format!("{}: cannot create: {e}", path.display()))
}

/// How messages name the output.
pub fn shown(path: &Path) -> String {
    if is_stdout(path) { "standard output".to_string() } else { path.display().to_string() }
}

/// Removes an output that turned out empty (never standard output).
pub fn remove(path: &Path) {
    if !is_stdout(path) {
        let _ = std::fs::remove_file(path);
    }
}
