//! The sidecar's stderr, rate-limited: what clients cause (bad lines, refused connections, a
//! ledger that cannot be read) could otherwise write as fast as clients can connect. Each kind of
//! line gets at most `BURST` lines per `WINDOW`; the rest are counted, and the count is printed
//! once the window is over ("... N similar lines suppressed").

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const WINDOW: Duration = Duration::from_secs(10);
const BURST: u32 = 20;

struct Window {
    start: Instant,
    printed: u32,
    suppressed: u64,
}

static WINDOWS: Mutex<Option<HashMap<&'static str, Window>>> = Mutex::new(None);

/// Prints `line` unless `kind` has used up its lines for this window.
pub fn log(kind: &'static str, line: &str) {
    let now = Instant::now();
    let mut guard = WINDOWS.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    let w = map.entry(kind).or_insert(Window { start: now, printed: 0, suppressed: 0 });
    if now.duration_since(w.start) >= WINDOW {
        report(kind, w);
        *w = Window { start: now, printed: 0, suppressed: 0 };
    }
    if w.printed < BURST {
        w.printed += 1;
        eprintln!("vramcap: sidecar: {line}");
    } else {
        w.suppressed += 1;
    }
}

fn report(kind: &str, w: &Window) {
    if w.suppressed > 0 {
        let secs = WINDOW.as_secs();
        eprintln!("vramcap: sidecar: {} similar lines ({kind}) suppressed in {secs} s", w.suppressed);
    }
}

/// Prints the counts of windows that are over (called from the server's loop, so a flood that
/// stopped is still reported).
pub fn flush() {
    let now = Instant::now();
    let mut guard = WINDOWS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(map) = guard.as_mut() {
        map.retain(|kind, w| {
            if now.duration_since(w.start) < WINDOW {
                return true;
            }
            report(kind, w);
            false
        });
    }
}
