//! A work item's envelope as the JSON text it is stored and published as ([`Body`]), and
//! the writer the emitter builds it with ([`ObjectWriter`]).
//!
//! Guarantee: the text is exactly what serializing the same envelope as a `serde_json`
//! object would give — keys in byte order, strings escaped by `serde_json`, integers in
//! decimal, no whitespace — so an envelope reads the same whether it was built here or as
//! a JSON value, and a replay emits byte-identical bodies. The writer checks the key order
//! in debug builds (every test run); keys are written in the order the caller gives.
//!
//! Why text: every body the engine emits goes to the outbox as text. Building it as a tree
//! of maps first (one allocation per key, one per node), serializing the tree and dropping
//! it cost the engine more than deciding the transition. Callers that want to read a body
//! (scenario checks, tests) get it parsed once, on first use ([`Body::json`]).

use std::fmt;
use std::io::Write as _;
use std::ops::Deref;
use std::sync::OnceLock;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value as Json;

use crate::expr::{ExprError, Template, Vars};

/// An envelope as JSON text, parsed on demand.
#[derive(Clone, Default)]
pub struct Body {
    text: String,
    parsed: OnceLock<Json>,
}

impl Body {
    /// A body from JSON text. The text is trusted to be one JSON object (the emitter's
    /// output); [`Body::json`] reads anything else as `null`.
    fn from_text(text: String) -> Self {
        Self {
            text,
            parsed: OnceLock::new(),
        }
    }

    /// A body holding `value` serialized.
    pub fn from_json(value: &Json) -> Self {
        Self::from_text(value.to_string())
    }

    /// The JSON text.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The JSON text, owned.
    pub fn into_string(self) -> String {
        self.text
    }

    /// The body as a JSON value, parsed the first time it is asked for.
    pub fn json(&self) -> &Json {
        self.parsed
            .get_or_init(|| serde_json::from_str(&self.text).unwrap_or(Json::Null))
    }
}

impl PartialEq for Body {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl fmt::Debug for Body {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Display for Body {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Reads as its JSON value (parsed on first use), so `body["field"]` and `&body` where a
/// `&Value` is wanted work as on a value.
impl Deref for Body {
    type Target = Json;

    fn deref(&self) -> &Json {
        self.json()
    }
}

impl Serialize for Body {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.json().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Body {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Json::deserialize(d).map(|v| Self::from_json(&v))
    }
}

/// Writes one JSON object field by field, in the order given, which must be the keys' byte
/// order (checked in debug builds).
pub(crate) struct ObjectWriter {
    buf: Vec<u8>,
    /// Per open object: the last key written (empty before the first).
    last: Vec<&'static str>,
}

impl ObjectWriter {
    /// A writer with an open object.
    pub(crate) fn new() -> Self {
        let mut buf = Vec::with_capacity(512);
        buf.push(b'{');
        Self {
            buf,
            last: vec![""],
        }
    }

    fn key(&mut self, key: &'static str) {
        let last = self.last.last_mut();
        debug_assert!(
            last.as_ref().is_some_and(|l| l.is_empty() || **l < key),
            "envelope keys out of order: `{key}` after `{last:?}`"
        );
        if let Some(last) = last {
            if !last.is_empty() {
                self.buf.push(b',');
            }
            *last = key;
        }
        self.string(key);
        self.buf.push(b':');
    }

    fn string(&mut self, s: &str) {
        // Writing into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut self.buf, s);
    }

    /// A string field.
    pub(crate) fn str(&mut self, key: &'static str, value: &str) {
        self.key(key);
        self.string(value);
    }

    /// An unsigned integer field.
    pub(crate) fn uint(&mut self, key: &'static str, value: u64) {
        self.key(key);
        let _ = write!(self.buf, "{value}");
    }

    /// A boolean field.
    pub(crate) fn bool(&mut self, key: &'static str, value: bool) {
        self.key(key);
        self.buf
            .extend_from_slice(if value { b"true" } else { b"false" });
    }

    /// A null field.
    pub(crate) fn null(&mut self, key: &'static str) {
        self.key(key);
        self.buf.extend_from_slice(b"null");
    }

    /// A field holding any serializable value (a JSON value, an enum's serde form).
    pub(crate) fn value<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) {
        self.key(key);
        if serde_json::to_writer(&mut self.buf, value).is_err() {
            self.buf.extend_from_slice(b"null");
        }
    }

    /// A field holding a rendered template, written without building its value.
    pub(crate) fn template(
        &mut self,
        key: &'static str,
        t: &Template,
        vars: &Vars<'_>,
    ) -> Result<(), ExprError> {
        self.key(key);
        t.write(vars, &mut self.buf)
    }

    /// Opens an object field; its fields follow until [`ObjectWriter::close`].
    pub(crate) fn open(&mut self, key: &'static str) {
        self.key(key);
        self.buf.push(b'{');
        self.last.push("");
    }

    /// Closes the innermost open object.
    pub(crate) fn close(&mut self) {
        self.buf.push(b'}');
        self.last.pop();
    }

    /// Closes the outer object and returns the body.
    pub(crate) fn finish(mut self) -> Body {
        while !self.last.is_empty() {
            self.close();
        }
        // Only serde_json output and ASCII punctuation were written.
        Body::from_text(String::from_utf8(self.buf).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn writes_what_serde_json_writes_for_the_same_object() {
        let payload = json!({"z": [1, "two", {"b": null, "a": 2.5}], "a": "q\"uote\n", "m": -3});
        let mut w = ObjectWriter::new();
        w.str("a", "é \u{1} \\ \"");
        w.bool("b", false);
        w.open("c");
        w.null("base");
        w.uint("max", u64::MAX);
        w.close();
        w.value("payload", &payload);
        w.value("status", &crate::saga::Status::NeedsOperator);
        w.uint("v", 1);
        let body = w.finish();
        let same = json!({
            "a": "é \u{1} \\ \"", "b": false, "c": {"base": null, "max": u64::MAX},
            "payload": payload, "status": "needs_operator", "v": 1,
        });
        assert_eq!(body.as_str(), same.to_string());
        assert_eq!(body.json(), &same);
        assert_eq!(body["c"]["max"], u64::MAX);
        assert_eq!(Body::from_json(&same), body);
    }

    #[test]
    #[should_panic(expected = "out of order")]
    #[cfg(debug_assertions)]
    fn refuses_keys_out_of_order_in_debug_builds() {
        let mut w = ObjectWriter::new();
        w.str("b", "x");
        w.str("a", "y");
    }
}
