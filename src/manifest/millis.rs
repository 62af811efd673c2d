//! Manifest fields in milliseconds (`delay_ms`, `timeout_ms`, `open_ms`, `base_backoff`,
//! `max_backoff`): a whole number, and text such as `"30m"` refused with a message that gives
//! the number to write instead, rather than the parser's "invalid u64".

use serde::de::{Deserialize, Deserializer, Error};

/// How a milliseconds field may be written in YAML.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Raw {
    Whole(u64),
    Negative(i64),
    Fraction(f64),
    Text(String),
}

fn whole<E: Error>(raw: Raw) -> Result<u64, E> {
    match raw {
        Raw::Whole(n) => Ok(n),
        Raw::Negative(n) => Err(E::custom(format!(
            "{n} is negative: a number of milliseconds is 0 or more"
        ))),
        Raw::Fraction(f) => Err(E::custom(format!(
            "{f} is not a whole number of milliseconds"
        ))),
        Raw::Text(s) => Err(E::custom(match humantime::parse_duration(s.trim()) {
            Ok(d) => format!(
                "a number of milliseconds is wanted, not text: write {} for {s:?}",
                d.as_millis()
            ),
            Err(_) => format!("a number of milliseconds is wanted, not {s:?}"),
        })),
    }
}

/// A required milliseconds field.
pub(super) fn required<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    whole(Raw::deserialize(d)?)
}

/// An optional milliseconds field.
pub(super) fn optional<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<Raw>::deserialize(d)?.map(whole).transpose()
}
