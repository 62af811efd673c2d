//! The one check for NATS subjects (and KV keys, which are subjects) that Runner builds
//! from values it does not control: a rendered `nats_publish` / `nats_request` subject, a
//! tenant named in an admin request, an aggregate id rendered from an event, a tenant or
//! command id read off a command's subject.
//!
//! Why it exists: nats-server reads every protocol line (`PUB`/`HPUB <subject> [reply]
//! <sizes>`) into a buffer of `max_control_line` bytes (4096 by default) and *closes the
//! connection* when a line is longer; a subject with a space or a line break splits the
//! line into a protocol error, which also closes it. Runner has one connection per
//! process, so a single input carrying a long or malformed token would cut every saga,
//! effect and lease of the node off the broker, once per input. Checking first turns that
//! into a refusal of the one input.
//!
//! Guarantee: [`check`] accepts a string only when it is a literal NATS subject of at most
//! [`Rule::max_bytes`]: not empty, no empty token (`..`, a leading or trailing `.`), no
//! whitespace or control character, no `*` or `>` (a publish names one subject, never a
//! pattern), and — for a [`Rule`] of one token — no `.`. Every other place that formats a
//! subject or key from outside input calls it, with one of the rules below.

/// Longest subject Runner publishes to when it is rendered from input (a `nats_publish` or
/// `nats_request` subject).
///
/// Chosen well below nats-server's default `max_control_line` of 4096 bytes because the
/// same protocol line also carries the reply subject (a `_INBOX.<22>.<22>` for requests,
/// JetStream's ack inbox for publishes to a stream), the header and total sizes, and the
/// verb; a quarter of the limit leaves room for all of them on a server configured with a
/// smaller control line, and is longer than any subject a service needs.
pub const MAX_SUBJECT_BYTES: usize = 1024;

/// Longest tenant token (the `<t>` of `tenant.<t>.…`); admission refuses longer ones.
pub const MAX_TENANT_BYTES: usize = 128;

/// Longest id token (a correlation id, aggregate id or command id inside a subject).
pub const MAX_ID_BYTES: usize = 512;

/// What a string must be: one token or a whole subject, and how long it may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// What the string is, for messages (`subject`, `tenant`, `aggregate id`).
    pub what: &'static str,
    /// Longest accepted, in bytes.
    pub max_bytes: usize,
    /// One token (no `.`), rather than a dotted subject.
    pub one_token: bool,
}

impl Rule {
    /// A subject Runner publishes on (or sends a request to), rendered from input.
    pub const PUBLISH: Rule = Rule {
        what: "subject",
        max_bytes: MAX_SUBJECT_BYTES,
        one_token: false,
    };
    /// A tenant, as it appears in `tenant.<t>.…` subjects and in KV keys.
    pub const TENANT: Rule = Rule {
        what: "tenant",
        max_bytes: MAX_TENANT_BYTES,
        one_token: true,
    };
    /// An id inside a subject (aggregate id, correlation id, command id).
    pub const ID: Rule = Rule {
        what: "id",
        max_bytes: MAX_ID_BYTES,
        one_token: true,
    };
    /// A name that becomes one token (a stream or consumer name, a tenant in
    /// configuration), bounded only by the subject limit.
    pub const NAME: Rule = Rule {
        what: "name",
        max_bytes: MAX_SUBJECT_BYTES,
        one_token: true,
    };

    /// This rule naming the string `what`.
    pub const fn named(self, what: &'static str) -> Rule {
        Rule { what, ..self }
    }
}

/// Which rule a string broke; the message names the rule, never the string (it may be
/// long, or hold a secret rendered into a subject).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubjectError {
    /// Nothing at all.
    #[error("{what} is empty")]
    Empty {
        /// What the string is.
        what: &'static str,
    },
    /// Over the rule's length.
    #[error(
        "{what} is {bytes} bytes; the limit is {max} (nats-server closes the connection on a protocol line over its max_control_line)"
    )]
    TooLong {
        /// What the string is.
        what: &'static str,
        /// Its length.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// `..`, or a leading or trailing `.`.
    #[error("{what} has an empty token (`..`, or a leading or trailing `.`)")]
    EmptyToken {
        /// What the string is.
        what: &'static str,
    },
    /// A `.` where one token is wanted.
    #[error("{what} must be one subject token: it holds a `.`")]
    Dot {
        /// What the string is.
        what: &'static str,
    },
    /// Whitespace or a control character (they end or split the protocol line).
    #[error("{what} holds whitespace or a control character")]
    Space {
        /// What the string is.
        what: &'static str,
    },
    /// `*` or `>`: a pattern, not one subject.
    #[error("{what} holds the wildcard `{wildcard}`; a message is published on one subject")]
    Wildcard {
        /// What the string is.
        what: &'static str,
        /// The wildcard.
        wildcard: char,
    },
}

/// Checks `s` against `rule` (see the module doc); the first rule broken is the error.
pub fn check(s: &str, rule: Rule) -> Result<(), SubjectError> {
    let what = rule.what;
    if s.is_empty() {
        return Err(SubjectError::Empty { what });
    }
    if s.len() > rule.max_bytes {
        return Err(SubjectError::TooLong {
            what,
            bytes: s.len(),
            max: rule.max_bytes,
        });
    }
    if s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(SubjectError::Space { what });
    }
    if let Some(wildcard) = s.chars().find(|c| matches!(c, '*' | '>')) {
        return Err(SubjectError::Wildcard { what, wildcard });
    }
    if rule.one_token {
        if s.contains('.') {
            return Err(SubjectError::Dot { what });
        }
    } else if s.split('.').any(str::is_empty) {
        return Err(SubjectError::EmptyToken { what });
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn well_formed_subjects_and_tokens_pass() {
        for s in [
            "tenant.acme.notify.42",
            "a",
            "tenant._.svc-echo.x_y=z/1",
            "ünïcode.tøken",
        ] {
            assert_eq!(check(s, Rule::PUBLISH), Ok(()), "{s:?}");
        }
        assert_eq!(check(&"s".repeat(MAX_SUBJECT_BYTES), Rule::PUBLISH), Ok(()));
        assert_eq!(check(&"t".repeat(MAX_TENANT_BYTES), Rule::TENANT), Ok(()));
        assert_eq!(check("acme", Rule::TENANT), Ok(()));
        assert_eq!(check(&"i".repeat(MAX_ID_BYTES), Rule::ID), Ok(()));
    }

    #[test]
    fn each_rule_is_named_when_broken() {
        let p = Rule::PUBLISH;
        let what = "subject";
        assert_eq!(check("", p), Err(SubjectError::Empty { what }));
        let long = format!("tenant.t.{}", "x".repeat(5000));
        assert_eq!(
            check(&long, p),
            Err(SubjectError::TooLong {
                what,
                bytes: long.len(),
                max: MAX_SUBJECT_BYTES
            })
        );
        assert_eq!(
            check(&"s".repeat(MAX_SUBJECT_BYTES + 1), p),
            Err(SubjectError::TooLong {
                what,
                bytes: MAX_SUBJECT_BYTES + 1,
                max: MAX_SUBJECT_BYTES
            })
        );
        for s in ["a..b", ".a", "a.", "."] {
            assert_eq!(check(s, p), Err(SubjectError::EmptyToken { what }), "{s:?}");
        }
        for s in [
            "a b",
            "a\tb",
            "a\r\nPUB x 1",
            "a\0b",
            "a\u{7f}b",
            "a\u{85}b",
            "a\u{2003}b",
        ] {
            assert_eq!(check(s, p), Err(SubjectError::Space { what }), "{s:?}");
        }
        assert_eq!(
            check("a.*.c", p),
            Err(SubjectError::Wildcard {
                what,
                wildcard: '*'
            })
        );
        assert_eq!(
            check("a.>", p),
            Err(SubjectError::Wildcard {
                what,
                wildcard: '>'
            })
        );
        assert_eq!(
            check("a*b", p),
            Err(SubjectError::Wildcard {
                what,
                wildcard: '*'
            })
        );
    }

    #[test]
    fn tokens_hold_no_dot_and_tenants_are_bounded() {
        let t = Rule::TENANT;
        assert_eq!(check("a.b", t), Err(SubjectError::Dot { what: "tenant" }));
        assert_eq!(
            check(&"t".repeat(5000), t),
            Err(SubjectError::TooLong {
                what: "tenant",
                bytes: 5000,
                max: MAX_TENANT_BYTES
            })
        );
        assert_eq!(check("", t), Err(SubjectError::Empty { what: "tenant" }));
        assert_eq!(
            check("a b", Rule::ID.named("aggregate id")),
            Err(SubjectError::Space {
                what: "aggregate id"
            })
        );
    }

    #[test]
    fn messages_name_the_rule_not_the_value() {
        let secret = format!("tenant.t.{}", "hunter2".repeat(1000));
        let e = check(&secret, Rule::PUBLISH).unwrap_err().to_string();
        assert!(e.contains("the limit is 1024"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        let e = check("tenant.t.hunter2 x", Rule::PUBLISH)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "subject holds whitespace or a control character");
    }
}
