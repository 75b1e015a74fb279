//! A minimal pickle writer (protocol 2, no memo): dicts, lists, strings, ints, bools and
//! pairs — what PyTorch's memory snapshot needs. Without a memo every fragment is
//! self-contained, so parts written to separate files can be concatenated.

use std::io::{self, Write};

pub struct Pickler<W: Write> {
    pub w: W,
}

impl<W: Write> Pickler<W> {
    pub fn new(w: W) -> Self {
        Pickler { w }
    }
    pub fn proto(&mut self) -> io::Result<()> {
        self.w.write_all(&[0x80, 2])
    }
    pub fn stop(&mut self) -> io::Result<()> {
        self.w.write_all(b".")
    }
    pub fn mark(&mut self) -> io::Result<()> {
        self.w.write_all(b"(")
    }
    pub fn empty_dict(&mut self) -> io::Result<()> {
        self.w.write_all(b"}")
    }
    pub fn empty_list(&mut self) -> io::Result<()> {
        self.w.write_all(b"]")
    }
    /// Pops everything since the last mark into the dict below it, as key/value pairs.
    pub fn setitems(&mut self) -> io::Result<()> {
        self.w.write_all(b"u")
    }
    /// Pops everything since the last mark onto the list below it.
    pub fn appends(&mut self) -> io::Result<()> {
        self.w.write_all(b"e")
    }
    pub fn bool(&mut self, b: bool) -> io::Result<()> {
        self.w.write_all(&[if b { 0x88 } else { 0x89 }])
    }
    /// TUPLE2 of the two values just written.
    pub fn tuple2(&mut self) -> io::Result<()> {
        self.w.write_all(&[0x86])
    }
    pub fn str(&mut self, s: &str) -> io::Result<()> {
        self.w.write_all(b"X")?;
        self.w.write_all(&(s.len() as u32).to_le_bytes())?;
        self.w.write_all(s.as_bytes())
    }
    pub fn int(&mut self, v: i128) -> io::Result<()> {
        if (0..256).contains(&v) {
            self.w.write_all(&[b'K', v as u8])
        } else if (i32::MIN as i128..=i32::MAX as i128).contains(&v) {
            self.w.write_all(b"J")?;
            self.w.write_all(&(v as i32).to_le_bytes())
        } else {
            // LONG1: little-endian two's complement, shortest form that keeps the sign.
            let bytes = v.to_le_bytes();
            let mut n = 16;
            while n > 1 {
                let top = bytes[n - 1];
                let next_sign = bytes[n - 2] & 0x80;
                if (top == 0 && next_sign == 0) || (top == 0xff && next_sign != 0) {
                    n -= 1;
                } else {
                    break;
                }
            }
            self.w.write_all(&[0x8a, n as u8])?;
            self.w.write_all(&bytes[..n])
        }
    }
    pub fn key_str(&mut self, k: &str, v: &str) -> io::Result<()> {
        self.str(k)?;
        self.str(v)
    }
    pub fn key_int(&mut self, k: &str, v: i128) -> io::Result<()> {
        self.str(k)?;
        self.int(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_use_the_shortest_encoding() {
        let enc = |v: i128| {
            let mut p = Pickler::new(Vec::new());
            p.int(v).unwrap();
            p.w
        };
        assert_eq!(enc(5), vec![b'K', 5]);
        assert_eq!(enc(-1), vec![b'J', 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(enc(1 << 32), vec![0x8a, 5, 0, 0, 0, 0, 1]);
        assert_eq!(enc(0x80_0000_0000), vec![0x8a, 6, 0, 0, 0, 0, 0x80, 0]);
        assert_eq!(enc(-(1 << 40)), vec![0x8a, 6, 0, 0, 0, 0, 0, 0xff]);
    }
}
