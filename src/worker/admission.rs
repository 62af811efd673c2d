//! Admission: the checks that decide, before an input is routed, whether it can be
//! processed at all.
//!
//! An input from a stream is a subject and a body ([`RawInput`]). It is admitted when its
//! subject is `tenant.<t>.…` with a tenant of at most [`MAX_TENANT_BYTES`], the whole
//! message (its header block and body) is no larger than `saga.max_message_bytes`, its tenant is served here (`tenancy.allowed`), its
//! body is a JSON object, and the body's `tenant_id` equals the subject's tenant. Once
//! routed, the instance key it names must also fit a storage key ([`check_key`]). An
//! admitted input carries the bound its time is applied within ([`time_bound`]): the time
//! the broker stored it, ± `saga.max_clock_skew`.
//!
//! Guarantee: admission is a pure function of the input and the configured [`Limits`]: it
//! reads no state and writes nothing, so under the same limits an input is refused for the
//! same reason whenever it is met (first delivery, re-read after a crash, the redrive of an
//! input that never reached a saga; a redriven input whose saga is known was admitted
//! before and goes straight to routing). A refusal is not an error of the batch: the caller
//! records it as a dead letter of the returned kind and goes on.

use serde_json::Value as Json;

use crate::deadletter::kind;
use crate::saga::{Input, TimeBound};

/// The default of `saga.max_clock_skew`, in ms (also what `runner test` applies).
pub use crate::saga::DEFAULT_MAX_CLOCK_SKEW_MS;

/// Longest tenant token accepted, and longest correlation id or event id accepted (the
/// bounds of [`crate::subject`], which every subject built from input is checked against).
pub use crate::subject::{MAX_ID_BYTES, MAX_TENANT_BYTES};

/// Whether `t` can be a tenant: what admission takes from a subject (`tenant.<t>.…`) and
/// configuration from `tenancy.allowed` — a subject token (no `.`, `*`, `>`, whitespace or
/// control character, so no NUL, the store's key separator) of 1 to [`MAX_TENANT_BYTES`]
/// bytes ([`crate::subject::Rule::TENANT`]). Admission dead-letters an input whose subject
/// names any other tenant, and the admin API refuses it with [`TENANT_RULE`].
pub fn is_tenant(t: &str) -> bool {
    crate::subject::check(t, crate::subject::Rule::TENANT).is_ok()
}

/// [`is_tenant`] in words, for answers that refuse a tenant.
pub const TENANT_RULE: &str =
    "a tenant is 1 to 128 bytes with no whitespace, control character, `.`, `*` or `>`";

/// A tenant as an answer refusing it shows it: control characters escaped, cut after 64
/// characters.
pub fn shown_tenant(t: &str) -> String {
    let mut cut: String = t.chars().take(64).collect();
    if cut.len() < t.len() {
        cut.push('…');
    }
    crate::telemetry::escape_controls(&cut).into_owned()
}

/// One input as it came off a stream.
#[derive(Debug, Clone)]
pub struct RawInput {
    /// Full subject, `tenant.<t>.…`.
    pub subject: String,
    /// Body bytes; a large body is shared with the message it came in (see `consume/chunk.rs`).
    pub body: bytes::Bytes,
    /// `traceparent` header, if it had a valid one (`broker::headers::traceparent`).
    pub traceparent: Option<String>,
    /// Bytes of the message's header block as it was published (0 for none, or when the
    /// input was stored without it: a held or redriven input, admitted once already; a
    /// routed copy, whose router counted the original's).
    pub header_bytes: usize,
    /// Set on a routed copy its router refused as too large (it counted the original
    /// message whole, and may have had to send a copy without its body): the reason.
    pub refused: Option<String>,
    /// `stream:seq`, for dead letters.
    pub source: String,
    /// Set on a routed copy of a tenant with a cap on running instances
    /// (`tenancy.live_instance_caps`, header `Runner-Live-Cap`): the cap in force when its
    /// router copied it. An input that would start an instance is held at the partition's
    /// part of it (`worker/cap.rs`); carried by the input, so every replay of the inbox
    /// decides the same way.
    pub live_cap: Option<u64>,
    /// Likewise for a cap on pending timers (`tenancy.pending_timer_caps`, header
    /// `Runner-Timer-Cap`).
    pub timer_cap: Option<u64>,
    /// When the broker stored the input, ms since the epoch: the JetStream timestamp of the
    /// message read (fixed per stream sequence, so a re-read gets the same value); for a
    /// routed copy, its source message's (header `Runner-Source-Time`, the copy's own
    /// timestamp when absent); for a held or dead-lettered input applied again, the value
    /// kept with it (else when it was dead-lettered). The input's time is applied within
    /// `saga.max_clock_skew` of it ([`time_bound`]). `None`: no broker time (a timer firing,
    /// whose time is Runner's own; tests), the input's timestamp is applied as it is.
    pub stored_ms: Option<u64>,
}

/// The caps an input is measured by when it would start an instance (`worker/cap.rs`): the
/// ones in force when its router copied it, or that a held input kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Caps {
    /// On running instances (`tenancy.live_instance_caps`).
    pub live: Option<u64>,
    /// On pending timers (`tenancy.pending_timer_caps`).
    pub timers: Option<u64>,
}

impl Caps {
    /// The caps `raw` came with.
    pub fn of(raw: &RawInput) -> Self {
        Self {
            live: raw.live_cap,
            timers: raw.timer_cap,
        }
    }

    /// The caps a held input kept.
    pub fn kept(dl: &crate::storage::tables::DeadLetter) -> Self {
        Self {
            live: dl.live_cap,
            timers: dl.timer_cap,
        }
    }

    /// Each cap of `self`, or where it has none, `other`'s.
    pub fn or(self, other: Self) -> Self {
        Self {
            live: self.live.or(other.live),
            timers: self.timers.or(other.timers),
        }
    }

    /// Whether neither cap is set.
    pub fn none(&self) -> bool {
        self.live.is_none() && self.timers.is_none()
    }
}

/// Settings the processor needs.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Allowed tenants; empty means any.
    pub allowed_tenants: Vec<String>,
    /// Largest accepted input, header block and body together.
    pub max_message_bytes: usize,
    /// The broker's `max_payload`, which bounds every message Runner publishes (headers
    /// and body, `broker::headers::record_fits`); 0 when unknown (no check). An input whose
    /// outputs would not fit is dead-lettered instead of applied.
    pub max_payload: usize,
    /// Most bytes of outputs one transaction writes (`saga.max_batch_bytes`): an input whose
    /// outputs alone pass it is dead-lettered, and a transaction stops taking inputs once
    /// its outputs reach it (the rest wait for the next one).
    pub max_output_bytes: usize,
    /// `saga.max_clock_skew` in ms: how far an input's `timestamp_ms` may lie from the time
    /// the broker stored it ([`time_bound`]).
    pub max_clock_skew_ms: u64,
    /// The deployment key's seals: a control input must carry one (`worker/control.rs`).
    pub seal: crate::seal::Seal,
}

/// The bound an input stored by the broker at `stored_ms` is applied within (see
/// [`crate::saga::TimeBound`]); none without a stored time.
pub fn time_bound(stored_ms: Option<u64>, limits: &Limits) -> Option<TimeBound> {
    stored_ms.map(|stored_ms| TimeBound {
        stored_ms,
        skew_ms: limits.max_clock_skew_ms,
    })
}

impl Limits {
    /// The limits configured for this process.
    pub fn from_config(c: &crate::config::Config) -> Self {
        Self {
            allowed_tenants: c.tenancy.allowed.clone(),
            max_message_bytes: usize::try_from(c.saga.max_message_bytes.get())
                .unwrap_or(usize::MAX),
            max_payload: 0,
            max_output_bytes: usize::try_from(c.saga.max_batch_bytes.get()).unwrap_or(usize::MAX),
            max_clock_skew_ms: u64::try_from(c.saga.max_clock_skew.get().as_millis())
                .unwrap_or(u64::MAX),
            seal: crate::seal::Seal::none(),
        }
    }

    /// These limits with the deployment key's seals (see [`Limits::seal`]).
    pub fn with_seal(mut self, seal: &crate::seal::Seal) -> Self {
        self.seal = seal.clone();
        self
    }

    /// These limits with the broker's `max_payload` (see [`Limits::max_payload`]).
    pub fn with_max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }
}

/// Splits `tenant.<t>.<rest>` into (t, rest).
pub fn split_subject(subject: &str) -> Option<(&str, &str)> {
    let rest = subject.strip_prefix("tenant.")?;
    let (t, rel) = rest.split_once('.')?;
    (!t.is_empty() && !rel.is_empty() && !t.contains('\0')).then_some((t, rel))
}

/// An input that passed admission, ready to be routed.
#[derive(Debug, Clone)]
pub struct Admitted<'r> {
    /// The tenant, from the subject (and equal to the body's `tenant_id`).
    pub tenant: &'r str,
    /// The input for the engine: the subject after `tenant.<t>.` and the body.
    pub input: Input,
}

/// Why an input cannot be processed: it becomes a dead letter of `kind`.
#[derive(Debug, Clone)]
pub struct Refusal<'r> {
    /// The tenant to file it under (`_` when the subject names none that can be used).
    pub tenant: &'r str,
    /// Reason class, one of [`kind`].
    pub kind: &'static str,
    /// What went wrong, for a person.
    pub reason: String,
}

fn refuse<'r>(tenant: &'r str, kind: &'static str, reason: impl Into<String>) -> Refusal<'r> {
    Refusal {
        tenant,
        kind,
        reason: reason.into(),
    }
}

/// Why `raw` is larger than `saga.max_message_bytes` allows, counting its header block
/// and body together; `None` when it is not.
pub fn oversized(raw: &RawInput, limits: &Limits) -> Option<String> {
    let whole = raw.body.len().saturating_add(raw.header_bytes);
    (whole > limits.max_message_bytes).then(|| {
        format!(
            "message is {whole} bytes ({} of body, {} of headers); the limit is {}",
            raw.body.len(),
            raw.header_bytes,
            limits.max_message_bytes
        )
    })
}

/// Checks the envelope of `raw` against `limits`, in the order given in the module doc;
/// the first check that fails decides the refusal.
pub fn admit<'r>(raw: &'r RawInput, limits: &Limits) -> Result<Admitted<'r>, Refusal<'r>> {
    let unknown = "_";
    let Some((tenant, rel)) = split_subject(&raw.subject) else {
        return Err(refuse(
            unknown,
            kind::UNDECODABLE,
            "subject is not tenant.<t>.…",
        ));
    };
    if tenant.len() > MAX_TENANT_BYTES {
        let why = format!(
            "tenant token is {} bytes; the limit is {MAX_TENANT_BYTES}",
            tenant.len()
        );
        return Err(refuse(unknown, kind::TOO_LARGE, why));
    }
    if !is_tenant(tenant) {
        let why = format!("`{}` is not a tenant: {TENANT_RULE}", shown_tenant(tenant));
        return Err(refuse(unknown, kind::UNDECODABLE, why));
    }
    if let Some(why) = &raw.refused {
        return Err(refuse(tenant, kind::TOO_LARGE, why.clone()));
    }
    if let Some(why) = oversized(raw, limits) {
        return Err(refuse(tenant, kind::TOO_LARGE, why));
    }
    if !limits.allowed_tenants.is_empty() && !limits.allowed_tenants.iter().any(|t| t == tenant) {
        let why = format!("tenant `{tenant}` is not served here");
        return Err(refuse(tenant, kind::UNKNOWN_TENANT, why));
    }
    let body: Json = match serde_json::from_slice(&raw.body) {
        Ok(b @ Json::Object(_)) => b,
        Ok(_) => {
            return Err(refuse(
                tenant,
                kind::UNDECODABLE,
                "body is not a JSON object",
            ));
        }
        Err(e) => {
            let why = format!("body is not JSON: {e}");
            return Err(refuse(tenant, kind::UNDECODABLE, why));
        }
    };
    match body.get("tenant_id").and_then(Json::as_str) {
        Some(t) if t == tenant => {}
        Some(t) => {
            let why = format!("subject tenant `{tenant}` differs from body tenant `{t}`");
            return Err(refuse(tenant, kind::TENANT_MISMATCH, why));
        }
        None => return Err(refuse(tenant, kind::UNDECODABLE, "body has no tenant_id")),
    }
    Ok(Admitted {
        tenant,
        input: Input::new(rel, body).with_bound(time_bound(raw.stored_ms, limits)),
    })
}

/// Checks the instance key and event id an input was routed to. Storage keys are bounded
/// (libmdbx refuses keys over about 2 KiB, which would fail the whole batch again and
/// again) and separate their parts with 0x00 (an id holding one could alias another key),
/// so an over-long id or one with a NUL is poison, not a storage error.
pub fn check_key<'r>(tenant: &'r str, corr: &str, event_id: &str) -> Result<(), Refusal<'r>> {
    if corr.len() > MAX_ID_BYTES || event_id.len() > MAX_ID_BYTES {
        let why = format!(
            "correlation id ({} bytes) or event id ({} bytes) is over the {MAX_ID_BYTES}-byte limit",
            corr.len(),
            event_id.len()
        );
        return Err(refuse(tenant, kind::TOO_LARGE, why));
    }
    if corr.contains('\0') || event_id.contains('\0') {
        let why = "correlation id or event id contains a NUL character";
        return Err(refuse(tenant, kind::UNDECODABLE, why));
    }
    Ok(())
}

/// Whether the envelope lacks what every input needs (`v: 1`, a non-empty `event_id`, a
/// `timestamp_ms`), as opposed to an expression failing on a well-formed input: it decides
/// between the dead-letter kinds `undecodable` and `expression` when the engine refuses an
/// input.
pub fn envelope_malformed(input: &Input) -> bool {
    let b = &input.body;
    b.get("v").and_then(Json::as_u64) != Some(1)
        || b.get("event_id")
            .and_then(Json::as_str)
            .is_none_or(str::is_empty)
        || b.get("timestamp_ms").and_then(Json::as_u64).is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(subject: &str, body: &str) -> RawInput {
        RawInput {
            subject: subject.into(),
            body: bytes::Bytes::copy_from_slice(body.as_bytes()),
            traceparent: None,
            header_bytes: 0,
            refused: None,
            live_cap: None,
            timer_cap: None,
            source: "AGG:1".into(),
            stored_ms: None,
        }
    }

    fn refused(subject: &str, body: &str, limits: &Limits) -> (String, &'static str) {
        let r = raw(subject, body);
        let refusal = admit(&r, limits).expect_err("refused");
        (refusal.tenant.to_string(), refusal.kind)
    }

    #[test]
    fn each_envelope_check_refuses_with_its_kind_and_tenant() {
        let limits = Limits {
            max_payload: 0,
            max_output_bytes: usize::MAX,
            allowed_tenants: vec!["acme".into()],
            max_message_bytes: 64,
            max_clock_skew_ms: DEFAULT_MAX_CLOCK_SKEW_MS,
            seal: crate::seal::Seal::none(),
        };
        let ok = r#"{"tenant_id":"acme"}"#;
        let long_tenant = format!("tenant.{}.aggregate.A.1", "t".repeat(MAX_TENANT_BYTES + 1));
        let cases = [
            ("aggregate.A.1", ok, "_", kind::UNDECODABLE),
            (long_tenant.as_str(), ok, "_", kind::TOO_LARGE),
            (
                "tenant.acme.aggregate.A.1",
                &"x".repeat(65),
                "acme",
                kind::TOO_LARGE,
            ),
            (
                "tenant.other.aggregate.A.1",
                ok,
                "other",
                kind::UNKNOWN_TENANT,
            ),
            (
                "tenant.acme.aggregate.A.1",
                "[1]",
                "acme",
                kind::UNDECODABLE,
            ),
            ("tenant.acme.aggregate.A.1", "{", "acme", kind::UNDECODABLE),
            (
                "tenant.acme.aggregate.A.1",
                r#"{"tenant_id":"x"}"#,
                "acme",
                kind::TENANT_MISMATCH,
            ),
            ("tenant.acme.aggregate.A.1", "{}", "acme", kind::UNDECODABLE),
        ];
        for (subject, body, tenant, k) in cases {
            assert_eq!(
                refused(subject, body, &limits),
                (tenant.to_string(), k),
                "{subject} {body}"
            );
        }
        let r = raw("tenant.acme.aggregate.A.1", ok);
        let a = admit(&r, &limits).expect("admitted");
        assert_eq!(
            (a.tenant, a.input.subject.as_str()),
            ("acme", "aggregate.A.1")
        );
    }

    #[test]
    fn an_admitted_input_carries_its_stored_time_and_the_configured_skew() {
        let limits = Limits::from_config(&crate::config::Config::default());
        assert_eq!(limits.max_clock_skew_ms, DEFAULT_MAX_CLOCK_SKEW_MS);
        let mut r = raw(
            "tenant.acme.aggregate.A.1",
            r#"{"tenant_id":"acme","timestamp_ms":0}"#,
        );
        r.stored_ms = Some(1_800_000_000_000);
        let a = admit(&r, &limits).expect("admitted");
        let bound = TimeBound {
            stored_ms: 1_800_000_000_000,
            skew_ms: DEFAULT_MAX_CLOCK_SKEW_MS,
        };
        assert_eq!(a.input.bound, Some(bound));
        r.stored_ms = None;
        assert_eq!(admit(&r, &limits).expect("admitted").input.bound, None);
    }

    #[test]
    fn routed_keys_must_fit_a_storage_key() {
        assert!(check_key("acme", "o-1", "e-1").is_ok());
        let long = "x".repeat(MAX_ID_BYTES + 1);
        assert_eq!(
            check_key("acme", &long, "e").map_err(|r| r.kind),
            Err(kind::TOO_LARGE)
        );
        assert_eq!(
            check_key("acme", "o", &long).map_err(|r| r.kind),
            Err(kind::TOO_LARGE)
        );
        assert_eq!(
            check_key("acme", "o\0", "e").map_err(|r| r.kind),
            Err(kind::UNDECODABLE)
        );
    }

    #[test]
    fn the_tenant_rule_is_what_admission_takes_and_says_its_limit() {
        assert!(TENANT_RULE.contains(&format!(" {MAX_TENANT_BYTES} bytes")));
        for ok in ["acme", "a-b_c", "müller", &"t".repeat(MAX_TENANT_BYTES)] {
            assert!(is_tenant(ok), "{ok:?}");
            let subject = format!("tenant.{ok}.aggregate.A.1");
            assert_eq!(split_subject(&subject).map(|(t, _)| t), Some(ok));
        }
        let long = "t".repeat(MAX_TENANT_BYTES + 1);
        for bad in [
            "",
            "a\0b",
            "a b",
            "a.b",
            "*",
            "a>",
            "tab\t",
            "\u{1b}[31m",
            &long,
        ] {
            assert!(!is_tenant(bad), "{bad:?}");
        }
        // Admission refuses a subject naming such a tenant, naming the rule.
        let limits = Limits {
            allowed_tenants: Vec::new(),
            max_message_bytes: 1 << 20,
            max_payload: 0,
            max_output_bytes: usize::MAX,
            max_clock_skew_ms: DEFAULT_MAX_CLOCK_SKEW_MS,
            seal: crate::seal::Seal::none(),
        };
        let raw = raw("tenant.a\u{1b}[31m.aggregate.A.1", r#"{"tenant_id":"x"}"#);
        let refusal = admit(&raw, &limits).expect_err("refused");
        assert_eq!(refusal.kind, kind::UNDECODABLE);
        assert!(refusal.reason.contains(TENANT_RULE), "{}", refusal.reason);
        assert!(!refusal.reason.contains('\u{1b}'), "{}", refusal.reason);
    }
}
