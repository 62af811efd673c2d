//! `runner validate` on `grpc` effects: what the descriptor set allows is checked when the
//! manifest is loaded, and every problem names the file, the line and column of the setting
//! at fault, and what is wrong.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::grpc::committed_descriptors;
use common::run_to_exit;

/// One effect's settings block (indented under `settings:`), as a manifest.
fn manifest(settings: &str) -> String {
    format!(
        "format: 1\neffects:\n  - name: pay\n    provider: grpc\n    settings:\n{settings}    timeout_ms: 1000\n"
    )
}

/// Runs `runner validate` on `text`; returns (exit code, output, the file's path).
fn validate(dir: &std::path::Path, name: &str, text: &str) -> (Option<i32>, String, String) {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, text).unwrap();
    let p = path.to_str().unwrap().to_string();
    let (code, out) = run_to_exit(&["validate", &p], &[], Duration::from_secs(30));
    (code, out, p)
}

#[test]
fn descriptor_problems_are_reported_at_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let fds = committed_descriptors();
    let fds = fds.display();
    let garbage = dir.path().join("garbage.binpb");
    std::fs::write(&garbage, b"\xff\xfenot a descriptor set").unwrap();
    // (case, settings, line, column, what the message says)
    let cases: Vec<(&str, String, u32, u32, &str)> = vec![
        (
            "streaming",
            format!("      endpoint: http://127.0.0.1:1\n      method: payments.v1.Payments/WatchCharges\n      descriptors: {fds}\n"),
            7,
            7,
            "method `payments.v1.Payments/WatchCharges` is server-streaming; only unary methods can be called",
        ),
        (
            "no_method",
            format!("      endpoint: http://127.0.0.1:1\n      method: payments.v1.Payments/Refund\n      descriptors: {fds}\n"),
            7,
            7,
            "service `payments.v1.Payments` has no method `Refund` (it has: Charge, WatchCharges)",
        ),
        (
            "no_service",
            format!("      endpoint: http://127.0.0.1:1\n      method: payments.v2.Payments/Charge\n      descriptors: {fds}\n"),
            7,
            7,
            "service `payments.v2.Payments` is not in the descriptors (they have: payments.v1.Payments)",
        ),
        (
            "misspelt_field",
            format!("      endpoint: http://127.0.0.1:1\n      method: payments.v1.Payments/Charge\n      descriptors: {fds}\n      request:\n        customer_id: c\n        amonut: 5\n"),
            11,
            9,
            "setting `request.amonut`: message `payments.v1.ChargeRequest` has no field `amonut`",
        ),
        (
            "misspelt_nested_field",
            format!("      endpoint: http://127.0.0.1:1\n      method: payments.v1.Payments/Charge\n      descriptors: {fds}\n      request:\n        amount:\n          currency: EUR\n          units: 5\n"),
            12,
            11,
            "setting `request.amount.units`: message `payments.v1.Money` has no field `units` (its fields: unitsCents, currency)",
        ),
        (
            "not_descriptors",
            format!("      endpoint: http://127.0.0.1:1\n      method: payments.v1.Payments/Charge\n      descriptors: {}\n", garbage.display()),
            8,
            7,
            "is not a protobuf FileDescriptorSet",
        ),
        (
            "missing_descriptors",
            "      endpoint: http://127.0.0.1:1\n      method: payments.v1.Payments/Charge\n      descriptors: nowhere.binpb\n".to_string(),
            8,
            7,
            "cannot read",
        ),
        (
            "bad_method",
            "      endpoint: http://127.0.0.1:1\n      method: Charge\n".to_string(),
            7,
            7,
            "is not `package.Service/Method`",
        ),
        (
            "templated_endpoint",
            "      endpoint: \"http://${ saga.secrets.host }\"\n      method: a.B/C\n".to_string(),
            6,
            7,
            "setting `endpoint`: is not a template",
        ),
        (
            "bad_scheme",
            "      endpoint: grpc://127.0.0.1:1\n      method: a.B/C\n".to_string(),
            6,
            7,
            "must start with http:// or https://",
        ),
        (
            "endpoint_path",
            "      endpoint: http://127.0.0.1:1/api\n      method: a.B/C\n".to_string(),
            6,
            7,
            "has a path or query",
        ),
        (
            "tls_over_plain",
            "      endpoint: http://127.0.0.1:1\n      method: a.B/C\n      tls_ca_file: /etc/ssl/ca.pem\n".to_string(),
            8,
            7,
            "setting `tls_ca_file`: needs an https:// endpoint",
        ),
        (
            "half_client_cert",
            format!("      endpoint: https://127.0.0.1:1\n      method: a.B/C\n      tls_cert_file: {fds}\n"),
            8,
            7,
            "setting `tls_cert_file`: needs `tls_key_file` (its private key) too",
        ),
        (
            "uppercase_metadata",
            "      endpoint: http://127.0.0.1:1\n      method: a.B/C\n      metadata:\n        X-Api-Key: k\n".to_string(),
            9,
            9,
            "setting `metadata.X-Api-Key`: metadata names are lowercase",
        ),
        (
            "binary_metadata",
            "      endpoint: http://127.0.0.1:1\n      method: a.B/C\n      metadata:\n        trace-bin: k\n".to_string(),
            9,
            9,
            "binary (`-bin`) metadata is not supported",
        ),
        (
            "reserved_metadata",
            "      endpoint: http://127.0.0.1:1\n      method: a.B/C\n      metadata:\n        idempotency-key: mine\n".to_string(),
            9,
            9,
            "this name is set by the runner",
        ),
        (
            "bad_code",
            "      endpoint: http://127.0.0.1:1\n      method: a.B/C\n      retryable_codes: [INTERNAL, TEAPOT]\n".to_string(),
            8,
            7,
            "\"TEAPOT\" is not a gRPC status name",
        ),
    ];
    for (name, settings, line, col, says) in cases {
        let (code, out, path) = validate(dir.path(), name, &manifest(&settings));
        assert_eq!(code, Some(1), "{name}: {out}");
        let at = format!("{path}:{line}:{col}: error: effect `pay`: setting `");
        assert!(out.contains(&at), "{name}: expected `{at}` in:\n{out}");
        assert!(out.contains(says), "{name}: expected `{says}` in:\n{out}");
    }
}

#[test]
fn a_valid_grpc_effect_passes_with_a_file_or_with_reflection() {
    let dir = tempfile::tempdir().unwrap();
    let fds = committed_descriptors();
    let with_file = format!(
        "      endpoint: https://payments.example:443\n      method: payments.v1.Payments/Charge\n      descriptors: {}\n      request:\n        customerId: ${{ event.payload.c }}\n        amount: {{ unitsCents: 5, currency: EUR }}\n        labels: {{ any-key: x }}\n",
        fds.display()
    );
    let (code, out, _) = validate(dir.path(), "file", &manifest(&with_file));
    assert_eq!(code, Some(0), "{out}");
    let by_reflection = "      endpoint: http://127.0.0.1:1\n      method: payments.v1.Payments/Charge\n      request: { anything: 1 }\n";
    let (code, out, _) = validate(dir.path(), "reflection", &manifest(by_reflection));
    assert_eq!(
        code,
        Some(0),
        "without descriptors nothing more can be known: {out}"
    );
    // A relative `descriptors` path is read beside the manifest.
    std::fs::copy(&fds, dir.path().join("payments.binpb")).unwrap();
    let relative = "      endpoint: http://127.0.0.1:1\n      method: payments.v1.Payments/Charge\n      descriptors: payments.binpb\n";
    let (code, out, _) = validate(dir.path(), "relative", &manifest(relative));
    assert_eq!(code, Some(0), "{out}");
}
