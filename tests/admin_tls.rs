//! The admin API over TLS (`admin.tls_cert_file`, `admin.tls_key_file`). Real binary, real
//! nats-server, a test CA in `tests/fixtures/tls` (a server certificate for localhost and
//! 127.0.0.1, signed by `ca.pem`; test material only).
//!
//! - with both set, the probes, `/metrics` and the admin routes answer over TLS to a
//!   client trusting the CA, and the CLI's `--admin https://…` works with
//!   `RUNNER_ADMIN_CA_FILE`;
//! - the same port refuses plain HTTP, and a client that does not trust the CA refuses the
//!   server;
//! - a certificate that cannot be read, or a key without a certificate, stops the start
//!   with an error naming the setting and the file.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{NatsServer, RunnerProc, run_to_exit};

const CERT: &str = "tests/fixtures/tls/admin.pem";
const KEY: &str = "tests/fixtures/tls/admin.key";
const CA: &str = "tests/fixtures/tls/ca.pem";

fn ca() -> reqwest::Certificate {
    let pem = std::fs::read(common::repo_root().join(CA)).unwrap();
    reqwest::Certificate::from_pem(&pem).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_speaks_tls_only_to_clients_that_trust_its_ca() {
    let nats = NatsServer::start();
    let node = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "manifests",
        &[
            ("RUNNER__ADMIN__TLS_CERT_FILE", CERT),
            ("RUNNER__ADMIN__TLS_KEY_FILE", KEY),
        ],
    );
    let https = node.admin.replace("http://", "https://");
    let trusting = reqwest::Client::builder()
        .add_root_certificate(ca())
        .build()
        .unwrap();
    for path in ["/health", "/ready", "/metrics", "/info"] {
        let r = trusting.get(format!("{https}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path} over TLS");
    }
    let metrics = trusting
        .get(format!("{https}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("runner_admin_connections"), "{metrics}");

    // Plain HTTP on the TLS port gets no HTTP answer.
    let plain = reqwest::Client::new()
        .get(format!("{}/health", node.admin))
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    assert!(plain.is_err(), "plain HTTP answered: {plain:?}");
    // A client without the CA does not accept the server.
    let untrusting = reqwest::Client::new()
        .get(format!("{https}/health"))
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    let e = untrusting.expect_err("an unknown CA was accepted");
    assert!(e.is_connect(), "{e:?}");
    // The probes still answer after those failed handshakes.
    let r = trusting
        .get(format!("{https}/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // The CLI through the node, trusting the CA.
    let (code, out) = tokio::task::spawn_blocking({
        let https = https.clone();
        move || {
            run_to_exit(
                &["dlq", "list", "--all", "--admin", &https],
                &[("RUNNER_ADMIN_CA_FILE", CA)],
                Duration::from_secs(30),
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{out}");
    // Without the CA the CLI names the failure and fails.
    let (code, out) = tokio::task::spawn_blocking(move || {
        run_to_exit(
            &["dlq", "list", "--all", "--admin", &https],
            &[],
            Duration::from_secs(30),
        )
    })
    .await
    .unwrap();
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("cannot reach the admin API"), "{out}");
}

#[test]
fn an_unusable_certificate_stops_the_start_naming_the_file() {
    let nats = NatsServer::start();
    let url = nats.url();
    let data = tempfile::tempdir().unwrap();
    let data = data.path().to_str().unwrap();
    let run = |envs: &[(&str, &str)]| {
        run_to_exit(
            &[
                "run",
                "--mode",
                "saga",
                "--nats-url",
                &url,
                "--manifest",
                "manifests",
                "--admin-addr",
                "127.0.0.1:0",
                "--data-dir",
                data,
            ],
            envs,
            Duration::from_secs(60),
        )
    };
    let (code, out) = run(&[
        (
            "RUNNER__ADMIN__TLS_CERT_FILE",
            "tests/fixtures/tls/missing.pem",
        ),
        ("RUNNER__ADMIN__TLS_KEY_FILE", KEY),
    ]);
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("admin.tls_cert_file") && out.contains("missing.pem"),
        "{out}"
    );
    // The key where the certificate should be: no certificate in it.
    let (code, out) = run(&[
        ("RUNNER__ADMIN__TLS_CERT_FILE", KEY),
        ("RUNNER__ADMIN__TLS_KEY_FILE", KEY),
    ]);
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("admin.tls_cert_file"), "{out}");
    // Half a setting is refused before anything starts.
    let (code, out) = run(&[("RUNNER__ADMIN__TLS_CERT_FILE", CERT)]);
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("tls_key_file"), "{out}");
}
