//! The size grammar shared by every limit variable (and by the CLI's `--limit`).
//!
//! `<n>`                     bytes (an integer); below 1 MiB a unit is required (see below)
//! `<n><k|m|g|t>[i|b|ib]`     binary units, any case: `8g` = `8G` = `8GB` = `8GiB` = 8·2^30
//!                            (HAMi-core and MPS users write all of these and mean the same)
//! `<n>%`                    a share of the device's physical memory
//! `0`                       no limit
//! `<n>` may have a fractional part with a unit or `%` (`1.5GiB`, `12.5%`); bytes round down
//! (a non-zero size below one byte is an error: it must never become "no limit").
//!
//! A bare number below 1 MiB (`8`, `512`, `50`) is an error, not a byte count: no GPU job fits in
//! it, so it denies every allocation, and it is almost always a missing unit (`8` meant 8GiB,
//! `50` meant 50%). Write the unit, or `<n>b` for that many bytes on purpose.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Size {
    /// No limit (`0`).
    Unlimited,
    Bytes(u64),
    /// Percent of the device's physical total, in (0, 100].
    Percent(f64),
}

/// What a size must look like; every error message quotes it.
pub const SIZE_FORM: &str =
    "a size such as 8GiB, 8g, 512MiB, 1073741824 (bytes) or 50% (of the device), or 0 for no limit";

#[derive(Debug, Clone, PartialEq)]
pub struct SizeError(pub String);

impl fmt::Display for SizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Bare numbers (no unit) from here up are bytes; below it they ask for a unit.
pub const BARE_MIN: u64 = 1 << 20;

pub fn parse_size(input: &str) -> Result<Size, SizeError> {
    let s = input.trim();
    if s.is_empty() {
        return Err(SizeError("empty value".into()));
    }
    if s.starts_with('-') {
        return Err(SizeError("a size cannot be negative".into()));
    }
    let num_end = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(num_end);
    if num.is_empty() || num.starts_with('.') || num.ends_with('.') || num.matches('.').count() > 1 {
        return Err(SizeError(format!("`{s}` does not start with a number")));
    }
    let unit = unit.trim();
    if unit == "%" {
        let pct: f64 = num.parse().map_err(|_| SizeError(format!("bad number `{num}`")))?;
        if !(pct > 0.0 && pct <= 100.0) {
            return Err(SizeError(format!("{pct}% is outside 0% < share <= 100% (use 0 for no limit)")));
        }
        return Ok(Size::Percent(pct));
    }
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "ki" | "kb" | "kib" => 10,
        "m" | "mi" | "mb" | "mib" => 20,
        "g" | "gi" | "gb" | "gib" => 30,
        "t" | "ti" | "tb" | "tib" => 40,
        // `1,5g` is a decimal comma (a locale's way of writing 1.5): say so, not just "unit".
        _ if unit.starts_with(',') && unit[1..].starts_with(|c: char| c.is_ascii_digit()) => {
            let fixed = s.replacen(',', ".", 1);
            return Err(SizeError(format!("unknown unit `{unit}`: the decimal point is `.`, as in {fixed}")));
        }
        _ => return Err(SizeError(format!("unknown unit `{unit}`"))),
    };
    let bytes = if num.contains('.') {
        if shift == 0 {
            return Err(SizeError(format!("`{s}`: a byte count must be a whole number")));
        }
        let v: f64 = num.parse().map_err(|_| SizeError(format!("bad number `{num}`")))?;
        let b = v * (1u64 << shift) as f64;
        if !b.is_finite() || b >= u64::MAX as f64 {
            return Err(SizeError(format!("`{s}` is too large")));
        }
        // Rounding down to 0 would turn a (tiny) limit into "no limit" (found by fuzzing).
        if v > 0.0 && b < 1.0 {
            return Err(SizeError(format!("`{s}` is less than one byte (use 0 for no limit)")));
        }
        // A unit suffix that comes out below one KiB (`0.0000001g` = 107 bytes) is a slip of the
        // decimal point, as a bare `8` is a missing unit: it would deny every allocation.
        if v > 0.0 && b < 1024.0 {
            return Err(SizeError(format!(
                "`{s}` is only {} bytes: it would deny every allocation; check the decimal point (or write {}b if you mean bytes)",
                b as u64, b as u64
            )));
        }
        b as u64
    } else {
        let v: u64 = num.parse().map_err(|_| SizeError(format!("`{num}` is too large")))?;
        if unit.is_empty() && v > 0 && v < BARE_MIN {
            return Err(SizeError(format!(
                "`{s}` has no unit: as bytes it would deny every allocation; write {v}GiB, {v}MiB or \
                 {v}% (or {v}b if you mean bytes)"
            )));
        }
        v.checked_mul(1u64 << shift).ok_or_else(|| SizeError(format!("`{s}` is too large")))?
    };
    Ok(if bytes == 0 { Size::Unlimited } else { Size::Bytes(bytes) })
}

impl Size {
    /// Bytes for a device with `physical` bytes; 0 means no limit.
    pub fn bytes_for(self, physical: u64) -> u64 {
        match self {
            Size::Unlimited => 0,
            Size::Bytes(b) => b,
            Size::Percent(p) => (((physical as f64) * p / 100.0) as u64).max(1),
        }
    }
}

/// `8589934592` → `8.0 GiB`, for messages and reports.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{bytes} B") } else { format!("{v:.1} {}", UNITS[u]) }
}

#[cfg(test)]
mod tests {
    use super::*;
    const G: u64 = 1 << 30;

    #[test]
    fn binary_units_in_every_spelling() {
        for s in ["8g", "8G", "8GB", "8GiB", "8gib", "8Gi", "8 GiB", " 8g "] {
            assert_eq!(parse_size(s), Ok(Size::Bytes(8 * G)), "{s}");
        }
        assert_eq!(parse_size("512m"), Ok(Size::Bytes(512 << 20)));
        assert_eq!(parse_size("4k"), Ok(Size::Bytes(4096)));
        assert_eq!(parse_size("2T"), Ok(Size::Bytes(2 << 40)));
        assert_eq!(parse_size("1073741824"), Ok(Size::Bytes(G)));
        assert_eq!(parse_size("100b"), Ok(Size::Bytes(100)));
        assert_eq!(parse_size("1048576"), Ok(Size::Bytes(1 << 20)));
        assert_eq!(parse_size("1.5GiB"), Ok(Size::Bytes(3 * G / 2)));
    }

    #[test]
    fn zero_means_unlimited_and_percent_is_a_share() {
        assert_eq!(parse_size("0"), Ok(Size::Unlimited));
        assert_eq!(parse_size("0GiB"), Ok(Size::Unlimited));
        assert_eq!(parse_size("0.0GiB"), Ok(Size::Unlimited));
        assert_eq!(parse_size("50%"), Ok(Size::Percent(50.0)));
        assert_eq!(Size::Percent(50.0).bytes_for(80 * G), 40 * G);
        assert_eq!(Size::Percent(12.5).bytes_for(8 * G), G);
        assert_eq!(Size::Unlimited.bytes_for(8 * G), 0);
    }

    #[test]
    fn rejects_what_is_not_a_size() {
        for s in ["", "abc", "1.5x", "-1", "-4g", "g", "8q", "1.5", "1..5g", ".5g", "5.g", "0%", "150%",
            "99999999999999999999", "20000000t", "8 g b", "%", "00.0001KiB", "0.5b",
            "0.0000001g", "0.5k", "0.9KiB", "0.0000009m"]
        {
            assert!(parse_size(s).is_err(), "accepted {s:?}");
        }
    }

    #[test]
    fn a_bare_number_below_one_mib_asks_for_a_unit() {
        for s in ["8", "1", "512", "50", "1048575", " 8 "] {
            let e = parse_size(s).unwrap_err().0;
            assert!(e.contains("has no unit") && e.contains("GiB") && e.contains('%'), "{s}: {e}");
        }
        assert_eq!(parse_size("8b"), Ok(Size::Bytes(8)));
        assert_eq!(parse_size("1k"), Ok(Size::Bytes(1024)));
        assert_eq!(parse_size("1.0k"), Ok(Size::Bytes(1024)));
        let e = parse_size("0.0000001g").unwrap_err().0;
        assert!(e.contains("107 bytes") && e.contains("decimal point"), "{e}");
        let e = parse_size("1,5g").unwrap_err().0;
        assert!(e.contains("decimal point") && e.contains("1.5g"), "{e}");
        assert_eq!(parse_size("8B"), Ok(Size::Bytes(8)));
        assert_eq!(parse_size("0"), Ok(Size::Unlimited));
    }

    #[test]
    fn human_readable() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(8 * G), "8.0 GiB");
        assert_eq!(human(1536 << 20), "1.5 GiB");
    }
}
