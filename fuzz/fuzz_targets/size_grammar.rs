//! The size grammar (`VRAMCAP_LIMIT=8GiB`, `--limit`, every `_<i>` override) and the list form
//! (`0=8GiB,GPU-8932f937=2g`). Besides "never panics": a result is always in range, and a size
//! that is not written as zero never comes back as "no limit" (a cap must not fail open).
#![no_main]
use libfuzzer_sys::fuzz_target;
use vramcap_fuzz::limits::parse_list;
use vramcap_fuzz::size::{Size, human, parse_size};

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    match parse_size(s) {
        Ok(Size::Bytes(b)) => {
            assert!(b > 0);
            let _ = human(b);
        }
        Ok(Size::Percent(p)) => {
            assert!(p > 0.0 && p <= 100.0, "{p}");
            for total in [0, 1, 16 << 30, u64::MAX] {
                let b = Size::Percent(p).bytes_for(total);
                assert!(b >= 1 && b <= total.max(1), "{p}% of {total} = {b}");
            }
        }
        Ok(Size::Unlimited) => {
            let digits: String = s.trim().chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
            assert!(digits.chars().all(|c| c == '0' || c == '.'), "{s:?} parsed as no limit");
        }
        Err(e) => assert!(!e.0.is_empty()),
    }
    match parse_list("VRAMCAP_LIMIT", s) {
        Ok(entries) => assert!(!entries.is_empty()),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("VRAMCAP_LIMIT") && msg.contains("expected"), "{msg}");
        }
    }
});
