//! A small length-prefixed binary layout for records written on the hot path (outbox
//! records, history entries), cheaper to write and read than JSON and free of escaping;
//! partition snapshots ([`super::snapshot`]) use it too.
//!
//! A record starts with a format byte that is never `{`, so a reader can still decode the
//! JSON that older stores hold. Strings are a big-endian `u32` length and UTF-8 bytes (byte
//! strings the same, with any bytes); an absent optional string has the length `u32::MAX`;
//! integers are big-endian `u64`. A record may end with an unframed tail (the outbox body),
//! read with [`Reader::rest`]. Every read checks bounds: truncated or non-UTF-8 bytes are
//! reported as corrupt, never a panic.

use super::error::{Result, StorageError};

/// Builds one record.
pub struct Writer(Vec<u8>);

impl Writer {
    /// A record of format `format` with room for `capacity` bytes.
    pub fn new(format: u8, capacity: usize) -> Self {
        let mut v = Vec::with_capacity(capacity + 1);
        v.push(format);
        Self(v)
    }
    /// Appends a string.
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.bytes(s.as_bytes())
    }
    /// Appends a byte string (same framing as a string, any bytes).
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(&(b.len() as u32).to_be_bytes());
        self.0.extend_from_slice(b);
        self
    }
    /// Appends an optional string.
    pub fn opt_str(&mut self, s: Option<&str>) -> &mut Self {
        match s {
            Some(s) => self.str(s),
            None => {
                self.0.extend_from_slice(&u32::MAX.to_be_bytes());
                self
            }
        }
    }
    /// Appends an integer.
    pub fn u64(&mut self, n: u64) -> &mut Self {
        self.0.extend_from_slice(&n.to_be_bytes());
        self
    }
    /// Appends bytes without a length (only as the last field).
    pub fn tail(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    /// The encoded record.
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.0)
    }
}

/// Reads one record; `what` names it in errors.
pub struct Reader<'a> {
    rest: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader over `bytes` when they start with `format` (`None`: another format, such as
    /// the JSON of older stores).
    pub fn open(bytes: &'a [u8], format: u8, what: &'static str) -> Option<Self> {
        match bytes.split_first() {
            Some((f, rest)) if *f == format => Some(Self { rest, what }),
            _ => None,
        }
    }
    fn corrupt(&self, why: &str) -> StorageError {
        StorageError::Corrupt(format!("{}: {why}", self.what))
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.rest.len() < n {
            return Err(self.corrupt("truncated"));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    fn utf8(&self, b: &[u8]) -> Result<String> {
        String::from_utf8(b.to_vec()).map_err(|_| self.corrupt("not UTF-8"))
    }
    /// Reads an integer.
    pub fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_be_bytes(b.try_into().unwrap_or([0; 8])))
    }
    /// Reads an optional string.
    pub fn opt_str(&mut self) -> Result<Option<String>> {
        let len = u32::from_be_bytes(self.take(4)?.try_into().unwrap_or([0; 4]));
        if len == u32::MAX {
            return Ok(None);
        }
        let b = self.take(len as usize)?;
        self.utf8(b).map(Some)
    }
    /// Reads a byte string written by [`Writer::bytes`].
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let len = u32::from_be_bytes(self.take(4)?.try_into().unwrap_or([0; 4]));
        if len == u32::MAX {
            return Err(self.corrupt("missing bytes"));
        }
        self.take(len as usize)
    }
    /// Whether every byte has been read.
    pub fn is_done(&self) -> bool {
        self.rest.is_empty()
    }
    /// Reads a string.
    pub fn str(&mut self) -> Result<String> {
        self.opt_str()?
            .ok_or_else(|| self.corrupt("missing string"))
    }
    /// Reads the unframed tail as text.
    pub fn rest(&mut self) -> Result<String> {
        let b = std::mem::take(&mut self.rest);
        self.utf8(b)
    }
}
