//! Value types used in config: human durations and byte sizes, parsed from strings so the
//! unit is always written next to the number (`"30s"`, `"1GiB"`).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

/// A duration written as a string with a unit: `"500ms"`, `"30s"`, `"5m"`, `"1h 30m"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    /// A duration of `s` seconds.
    pub const fn secs(s: u64) -> Self {
        Self(Duration::from_secs(s))
    }
    /// A duration of `ms` milliseconds.
    pub const fn millis(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }
    /// The wrapped [`Duration`].
    pub const fn get(self) -> Duration {
        self.0
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl FromStr for HumanDuration {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        humantime::parse_duration(s.trim()).map(HumanDuration).map_err(|e| {
            format!("invalid duration {s:?} ({e}); write a number with a unit, like \"30s\" or \"500ms\"")
        })
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = HumanDuration;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string with a unit, like \"30s\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<HumanDuration, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<HumanDuration, E> {
                Err(E::custom(format!(
                    "invalid duration {v}: a bare number has no unit; write \"{v}s\" or \"{v}ms\""
                )))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<HumanDuration, E> {
                self.visit_i64(v as i64)
            }
        }
        d.deserialize_any(V)
    }
}

/// A size in bytes written as a string with a unit: `"512MiB"`, `"4GiB"`, `"1048576B"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// `n` kibibytes.
    pub const fn kib(n: u64) -> Self {
        Self(n * 1024)
    }
    /// `n` mebibytes.
    pub const fn mib(n: u64) -> Self {
        Self(n * 1024 * 1024)
    }
    /// `n` gibibytes.
    pub const fn gib(n: u64) -> Self {
        Self(n * 1024 * 1024 * 1024)
    }
    /// The number of bytes.
    pub const fn get(self) -> u64 {
        self.0
    }
}

const UNITS: [(&str, u64); 9] = [
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("TB", 1_000_000_000_000),
    ("GB", 1_000_000_000),
    ("MB", 1_000_000),
    ("KB", 1_000),
    ("B", 1),
];

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (unit, mult) in &UNITS[..4] {
            if self.0 >= *mult && self.0.is_multiple_of(*mult) {
                return write!(f, "{}{unit}", self.0 / mult);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let bad = || {
            format!("invalid size {s:?}; write a number with a unit, like \"512MiB\" or \"4GiB\"")
        };
        let (unit, mult) = UNITS.iter().find(|(u, _)| t.ends_with(u)).ok_or_else(bad)?;
        let num: u64 = t[..t.len() - unit.len()]
            .trim()
            .parse()
            .map_err(|_| bad())?;
        num.checked_mul(*mult).map(ByteSize).ok_or_else(bad)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(de::Error::custom)
    }
}

/// Accepts either a list of strings or one comma-separated string (handy in environment
/// variables: `RUNNER__NATS__URLS=nats://a:4222,nats://b:4222`).
pub(crate) fn string_or_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => s
            .split(',')
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty())
            .collect(),
        OneOrMany::Many(v) => v,
    })
}

/// [`string_or_list`] for paths.
pub(crate) fn paths_or_list<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Vec<std::path::PathBuf>, D::Error> {
    Ok(string_or_list(d)?
        .into_iter()
        .map(std::path::PathBuf::from)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_need_units() {
        assert_eq!("30s".parse::<HumanDuration>(), Ok(HumanDuration::secs(30)));
        assert_eq!(
            "250ms".parse::<HumanDuration>(),
            Ok(HumanDuration::millis(250))
        );
        assert!("30".parse::<HumanDuration>().is_err());
        assert!("soon".parse::<HumanDuration>().is_err());
    }

    #[test]
    fn sizes_round_trip() {
        for s in ["512MiB", "4GiB", "1000B", "3KiB"] {
            let b: ByteSize = s.parse().expect("parses");
            assert_eq!(b.to_string(), s);
        }
        assert_eq!("1GB".parse::<ByteSize>(), Ok(ByteSize(1_000_000_000)));
        assert!("12 parsecs".parse::<ByteSize>().is_err());
        assert!("99999999999TiB".parse::<ByteSize>().is_err());
    }
}
