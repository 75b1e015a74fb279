//! A single-pass scanner for flat JSON objects (one trace line). Event lines are flat objects of
//! numbers and plain strings; scanning them without building a value tree is what lets `report`
//! keep up with millions of events per second. Anything unusual (escapes, nested values) is
//! reported as `Unusual` so the caller can fall back to serde_json for that one line.

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Val<'a> {
    /// A string without escapes: the bytes between the quotes.
    Str(&'a [u8]),
    /// A number's text, validated to be made of number characters.
    Num(&'a [u8]),
    Null,
    Bool(bool),
}

#[derive(Debug, PartialEq)]
pub enum ScanError {
    /// Valid JSON the fast path does not handle (escapes, nested values): use serde_json.
    Unusual,
    /// Not a JSON object: the line is corrupt or truncated.
    Corrupt(&'static str),
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\r' | b'\n') {
        i += 1;
    }
    i
}

/// Reads the string starting after the opening quote at `i`; returns (content, index after quote).
fn string(b: &[u8], i: usize) -> Result<(&[u8], usize), ScanError> {
    let rest = &b[i..];
    match memchr2(b'"', b'\\', rest) {
        Some(j) if rest[j] == b'"' => Ok((&rest[..j], i + j + 1)),
        Some(_) => Err(ScanError::Unusual),
        None => Err(ScanError::Corrupt("unterminated string")),
    }
}

#[inline]
fn memchr2(a: u8, b: u8, hay: &[u8]) -> Option<usize> {
    hay.iter().position(|&c| c == a || c == b)
}

/// Calls `f(key, value)` for every member of the flat object on `line`.
pub fn scan<'a>(line: &'a [u8], mut f: impl FnMut(&'a [u8], Val<'a>)) -> Result<(), ScanError> {
    let b = line;
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return Err(ScanError::Corrupt("not a JSON object"));
    }
    i = skip_ws(b, i + 1);
    if b.get(i) == Some(&b'}') {
        return finish(b, i + 1);
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return Err(ScanError::Corrupt("expected a field name"));
        }
        let (key, j) = string(b, i + 1)?;
        i = skip_ws(b, j);
        if b.get(i) != Some(&b':') {
            return Err(ScanError::Corrupt("expected `:`"));
        }
        i = skip_ws(b, i + 1);
        let c = *b.get(i).ok_or(ScanError::Corrupt("truncated"))?;
        let val = match c {
            b'"' => {
                let (s, j) = string(b, i + 1)?;
                i = j;
                Val::Str(s)
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < b.len() && matches!(b[i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') {
                    i += 1;
                }
                Val::Num(&b[start..i])
            }
            b'n' if b[i..].starts_with(b"null") => {
                i += 4;
                Val::Null
            }
            b't' if b[i..].starts_with(b"true") => {
                i += 4;
                Val::Bool(true)
            }
            b'f' if b[i..].starts_with(b"false") => {
                i += 5;
                Val::Bool(false)
            }
            b'{' | b'[' => return Err(ScanError::Unusual),
            _ => return Err(ScanError::Corrupt("bad value")),
        };
        f(key, val);
        i = skip_ws(b, i);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => return finish(b, i + 1),
            Some(_) => return Err(ScanError::Corrupt("expected `,` or `}`")),
            None => return Err(ScanError::Corrupt("truncated")),
        }
    }
}

fn finish(b: &[u8], i: usize) -> Result<(), ScanError> {
    if skip_ws(b, i) == b.len() { Ok(()) } else { Err(ScanError::Corrupt("text after the object")) }
}

/// An unsigned integer field; `None` for anything else (negative, fractional, overflowing).
#[inline]
pub fn uint(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 20 {
        return None;
    }
    let mut v: u64 = 0;
    for &c in s {
        let d = c.wrapping_sub(b'0');
        if d > 9 {
            return None;
        }
        v = v.checked_mul(10)?.checked_add(d as u64)?;
    }
    Some(v)
}

/// A signed integer field.
#[inline]
pub fn int(s: &[u8]) -> Option<i64> {
    match s.first() {
        Some(b'-') => uint(&s[1..]).and_then(|v| if v <= i64::MAX as u64 + 1 { Some((v as i64).wrapping_neg()) } else { None }),
        _ => uint(s).and_then(|v| i64::try_from(v).ok()),
    }
}

/// `"0x7f3a40000000"` → the pointer value.
#[inline]
pub fn hex(s: &[u8]) -> Option<u64> {
    let digits = s.strip_prefix(b"0x").or_else(|| s.strip_prefix(b"0X"))?;
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    let mut v: u64 = 0;
    for &c in digits {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            b'A'..=b'F' => c - b'A' + 10,
            _ => return None,
        };
        v = (v << 4) | d as u64;
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(line: &str) -> Result<Vec<(String, Val<'_>)>, ScanError> {
        let mut out = Vec::new();
        scan(line.as_bytes(), |k, v| out.push((String::from_utf8_lossy(k).into_owned(), v)))?;
        Ok(out)
    }

    #[test]
    fn scans_flat_objects() {
        let m = members(r#"{"type":"event","t_ns":12, "dev":-1,"x":null,"y":true}"#).unwrap();
        assert_eq!(m.len(), 5);
        assert_eq!(m[1], ("t_ns".into(), Val::Num(b"12")));
        assert_eq!(m[2], ("dev".into(), Val::Num(b"-1")));
        assert_eq!(m[4], ("y".into(), Val::Bool(true)));
    }

    #[test]
    fn rejects_truncated_and_garbage() {
        for bad in [r#"{"type":"event","t_ns":1"#, r#"{"type":"ev"#, "garbage", r#"{"a":1}x"#, r#"{"a" 1}"#, ""] {
            assert!(matches!(members(bad), Err(ScanError::Corrupt(_))), "{bad}");
        }
        assert_eq!(members(r#"{"a":"x\"y"}"#).unwrap_err(), ScanError::Unusual);
        assert_eq!(members(r#"{"a":[1]}"#).unwrap_err(), ScanError::Unusual);
    }

    #[test]
    fn numbers_and_pointers() {
        assert_eq!(uint(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(uint(b"18446744073709551616"), None);
        assert_eq!(uint(b"1.5"), None);
        assert_eq!(int(b"-2"), Some(-2));
        assert_eq!(hex(b"0x7f3a40000000"), Some(0x7f3a40000000));
        assert_eq!(hex(b"0x"), None);
        assert_eq!(hex(b"12"), None);
    }
}
