//! Entry points for coverage-guided fuzzing, shared by the fuzz targets in `fuzz/` and by the
//! ordinary test that replays their kept cases (`tests/fuzz_regressions.rs`).
//!
//! Each function takes arbitrary bytes, feeds them to one decoder or compiler that meets
//! untrusted input, and checks the properties that must hold for every input:
//! - nothing panics (a panic is the fuzzer's finding);
//! - what decodes re-encodes to something that decodes to the same value (codecs);
//! - a refusal is a value with a reason, never a silent success: a manifest that does not
//!   compile has at least one error diagnostic, every one with a message.
//!
//! The functions panic (`assert!`) when a property fails, which is how libFuzzer and the
//! regression test notice. They are not part of Runner's operational API.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde_json::{Value as Json, json};

use crate::effect::command::{Command, ResultType};
use crate::expr::{Expr, Template, Vars};
use crate::manifest::{Catalog, load_str};
use crate::saga::{Instance, apply, route};
use crate::storage::snapshot::SnapshotHeader;
use crate::storage::tables::{HistoryEntry, OutboxRecord};
use crate::worker::admission::{Limits, RawInput, admit, check_key};

/// The example manifests, compiled once: inputs are routed and applied against them.
fn catalog() -> &'static Catalog {
    static CATALOG: OnceLock<Catalog> = OnceLock::new();
    CATALOG.get_or_init(|| {
        let report = load_str(&[
            ("order.yaml", include_str!("../manifests/order.yaml")),
            ("travel.yaml", include_str!("../manifests/travel.yaml")),
        ]);
        report
            .catalog
            .unwrap_or_else(|| panic!("example manifests compile: {:?}", report.diagnostics))
    })
}

/// Admission limits for fuzzed inputs: any tenant, bodies up to 1 MiB.
fn limits() -> Limits {
    Limits {
        allowed_tenants: Vec::new(),
        max_message_bytes: 1 << 20,
        max_payload: 1 << 20,
        max_output_bytes: usize::MAX,
        max_clock_skew_ms: crate::saga::DEFAULT_MAX_CLOCK_SKEW_MS,
        seal: crate::seal::Seal::none(),
    }
}

/// The broker's stored time of every fuzzed input, so each input's time is bounded (and any
/// `timestamp_ms`, 0 and `u64::MAX` included, goes through the bound) as in the service.
const STORED_MS: u64 = 1_700_000_000_000;

/// Splits `data` at its first newline: (first line, rest).
fn split_line(data: &[u8]) -> (&[u8], &[u8]) {
    match data.iter().position(|b| *b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[]),
    }
}

/// Saga inputs as they come off a stream, separated by the byte 0x1E (at most eight): in
/// each, the first line is the subject and the rest the body. Each is admitted, routed and
/// applied to the instances the earlier ones left, as the saga worker would; every step
/// must answer (a transition or a refusal with a reason) without panicking.
pub fn envelope(data: &[u8]) {
    let limits = limits();
    let catalog = catalog();
    let mut instances: BTreeMap<(String, String), Instance> = BTreeMap::new();
    for one in data.split(|b| *b == 0x1E).take(8) {
        let (subject, body) = split_line(one);
        let raw = RawInput {
            subject: String::from_utf8_lossy(subject).into_owned(),
            body: bytes::Bytes::copy_from_slice(body),
            traceparent: None,
            header_bytes: 0,
            refused: None,
            live_cap: None,
            timer_cap: None,
            source: "FUZZ:1".into(),
            stored_ms: Some(STORED_MS),
        };
        let Ok(admitted) = admit(&raw, &limits) else {
            continue;
        };
        let Ok(routes) = route(catalog, &admitted.input) else {
            continue;
        };
        let event_id = admitted
            .input
            .body
            .get("event_id")
            .and_then(Json::as_str)
            .unwrap_or_default();
        for r in routes {
            if check_key(admitted.tenant, &r.correlation_id, event_id).is_err() {
                continue;
            }
            let key = (r.saga.clone(), r.correlation_id.clone());
            let stored = instances.get(&key);
            if let Ok(applied) = apply(catalog, &r.saga, &r.correlation_id, stored, &admitted.input)
            {
                instances.insert(key, applied.instance);
            }
        }
    }
}

/// A manifest text. Loading never panics; a manifest that does not compile says why.
pub fn manifest(data: &[u8]) {
    crate::effect::provider::check_settings_on_load();
    let text = String::from_utf8_lossy(data);
    let report = load_str(&[("fuzz.yaml", &text)]);
    if report.catalog.is_none() {
        let errors: Vec<_> = report.errors().collect();
        assert!(!errors.is_empty(), "refused without an error");
        for e in errors {
            assert!(!e.message.is_empty(), "error without a message: {e:?}");
        }
    }
}

/// An expression (first line) and a JSON event it is evaluated over (the rest, when it is
/// JSON). Also compiled as a template. Evaluation answers a value or an error, never panics.
pub fn expression(data: &[u8]) {
    let (src, event) = split_line(data);
    let src = String::from_utf8_lossy(src);
    let event: Json = serde_json::from_slice(event).unwrap_or_else(|_| json!({"n": 1}));
    let state = json!({"items": [1, 2], "total": 3, "name": "x"});
    let saga = json!({"tenant": "t", "name": "s", "version": 1, "correlation_id": "c"});
    let vars = Vars::new(&event, &state, &saga);
    if let Ok(e) = Expr::compile(&src) {
        let _ = e.eval(&vars);
        let _ = e.eval_bool(&vars);
        let _ = e.eval_string(&vars);
        let _ = e.eval_u64(&vars);
    }
    if let Ok(t) = Template::compile_str(&src) {
        let _ = t.render(&vars);
    }
}

/// Bytes read back from storage or from a snapshot. Decoders refuse corrupt bytes with an
/// error; what they accept re-encodes to bytes that decode to the same record.
pub fn storage_codecs(data: &[u8]) {
    if let Ok(rec) = OutboxRecord::decode(data) {
        let again = OutboxRecord::decode(&rec.encode()).expect("re-encoded outbox record");
        assert_eq!(again.encode(), rec.encode(), "outbox record round trip");
    }
    if let Ok(h) = HistoryEntry::decode(data) {
        let again = HistoryEntry::decode(&h.encode()).expect("re-encoded history entry");
        assert_eq!(again.encode(), h.encode(), "history entry round trip");
    }
    let _ = SnapshotHeader::read(data);
}

/// An effect command as it comes off WORKFLOW_COMMANDS: subject line, then body.
pub fn effect_command(data: &[u8]) {
    let (subject, body) = split_line(data);
    let subject = String::from_utf8_lossy(subject);
    let Ok(cmd) = Command::decode(&subject, body, None) else {
        return;
    };
    // The result an executor would publish goes back through the saga side's admission.
    let result = cmd.result(ResultType::Failed, &json!({"error": "fuzz"}), 1);
    let raw = RawInput {
        subject: result.subject,
        body: result.body.get().as_bytes().to_vec().into(),
        traceparent: None,
        header_bytes: 0,
        refused: None,
        live_cap: None,
        timer_cap: None,
        source: "FUZZ:1".into(),
        stored_ms: Some(STORED_MS),
    };
    let limits = limits();
    if let Ok(admitted) = admit(&raw, &limits) {
        let _ = route(catalog(), &admitted.input);
    }
}
