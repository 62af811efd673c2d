//! Runner authenticates to NATS with each scheme a server configuration offers — user and
//! password, token, nkey, TLS verified against a CA and mutual TLS (a CA and certificates
//! made for the test with openssl) — and a wrong secret fails with a clear error that never
//! contains the secret; neither do the logs, `/info` or `/metrics` of a running node. Real
//! nats-server (configured by the test), real binary. (Creds files with JWTs need an
//! operator-mode server and are not covered here.)
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;

/// Runs a node against `nats` with `env` until it is up; returns everything it showed.
async fn up_and_everything_shown(nats: &NatsServer, env: &[(&str, &str)]) -> String {
    let mut runner =
        RunnerProc::start(&["--nats-url", &nats.url(), "--manifest", "manifests"], env);
    let info = get_text(&format!("{}/info", runner.admin)).await;
    let metrics = get_text(&format!("{}/metrics", runner.admin)).await;
    let health = get_json(&format!("{}/health", runner.admin)).await;
    assert_eq!(health["status"], "ok", "{health}");
    runner.logged("");
    format!("{}\n{info}\n{metrics}", runner.log.join("\n"))
}

fn refused(nats: &NatsServer, env: &[(&str, &str)]) -> String {
    let data = tempfile::tempdir().unwrap();
    let mut all = vec![("RUNNER__NATS__CONNECT_TIMEOUT", "2s")];
    all.extend_from_slice(env);
    let (code, out) = run_to_exit(
        &[
            "run",
            "--nats-url",
            &nats.url(),
            "--data-dir",
            data.path().to_str().unwrap(),
            "--admin-addr",
            "127.0.0.1:0",
        ],
        &all,
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("cannot connect to NATS"), "{out}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_and_password() {
    let secret = "pw-7c1e9a-secret";
    let nats = NatsServer::start_with(&format!(
        "authorization {{ users = [ {{ user: alice, password: \"{secret}\" }} ] }}\n"
    ));
    let shown = up_and_everything_shown(
        &nats,
        &[
            ("RUNNER__NATS__USER", "alice"),
            ("RUNNER__NATS__PASSWORD", secret),
        ],
    )
    .await;
    assert!(!shown.contains(secret), "the password was shown");
    let wrong = "pw-wrong-41d2";
    let out = refused(
        &nats,
        &[
            ("RUNNER__NATS__USER", "alice"),
            ("RUNNER__NATS__PASSWORD", wrong),
        ],
    );
    assert!(out.contains("uthorization"), "{out}");
    assert!(!out.contains(wrong), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token() {
    let secret = "tok-93af0b-secret";
    let nats = NatsServer::start_with(&format!("authorization {{ token: \"{secret}\" }}\n"));
    let shown = up_and_everything_shown(&nats, &[("RUNNER__NATS__TOKEN", secret)]).await;
    assert!(!shown.contains(secret), "the token was shown");
    let wrong = "tok-wrong-77";
    let out = refused(&nats, &[("RUNNER__NATS__TOKEN", wrong)]);
    assert!(!out.contains(wrong), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nkey_seed_file() {
    let user = nkeys::KeyPair::new_user();
    let seed = user.seed().unwrap();
    let nats = NatsServer::start_with(&format!(
        "authorization {{ users = [ {{ nkey: {} }} ] }}\n",
        user.public_key()
    ));
    let dir = tempfile::tempdir().unwrap();
    let seed_file = dir.path().join("user.nk");
    std::fs::write(&seed_file, &seed).unwrap();
    let seed_path = seed_file.to_str().unwrap();
    let shown =
        up_and_everything_shown(&nats, &[("RUNNER__NATS__NKEY_SEED_FILE", seed_path)]).await;
    assert!(!shown.contains(&seed), "the seed was shown");
    let other = nkeys::KeyPair::new_user();
    let wrong_file = dir.path().join("other.nk");
    std::fs::write(&wrong_file, other.seed().unwrap()).unwrap();
    let out = refused(
        &nats,
        &[("RUNNER__NATS__NKEY_SEED_FILE", wrong_file.to_str().unwrap())],
    );
    assert!(!out.contains(&other.seed().unwrap()), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_mutual_tls_with_a_test_ca() {
    let dir = tempfile::tempdir().unwrap();
    common::postgres::make_test_ca(dir.path());
    let f = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    // Server TLS, verified by the runner against the test CA.
    let nats = NatsServer::start_with(&format!(
        "tls {{ cert_file: \"{}\", key_file: \"{}\" }}\n",
        f("server.pem"),
        f("server.key")
    ));
    let ca = f("ca.pem");
    let tls = [
        ("RUNNER__NATS__TLS_REQUIRED", "true"),
        ("RUNNER__NATS__TLS_CA_FILE", ca.as_str()),
    ];
    up_and_everything_shown(&nats, &tls).await;
    // Without the CA the server's certificate is not trusted.
    let out = refused(&nats, &[("RUNNER__NATS__TLS_REQUIRED", "true")]);
    assert!(
        out.to_lowercase().contains("certificate") || out.contains("tls"),
        "{out}"
    );
    drop(nats);

    // Mutual TLS: the server requires a client certificate from the CA.
    let nats = NatsServer::start_with(&format!(
        "tls {{ cert_file: \"{}\", key_file: \"{}\", ca_file: \"{}\", verify: true }}\n",
        f("server.pem"),
        f("server.key"),
        f("ca.pem")
    ));
    let (cert, key) = (f("client.pem"), f("client.key"));
    let mut mtls = tls.to_vec();
    mtls.push(("RUNNER__NATS__TLS_CERT_FILE", cert.as_str()));
    mtls.push(("RUNNER__NATS__TLS_KEY_FILE", key.as_str()));
    let shown = up_and_everything_shown(&nats, &mtls).await;
    let key_text = std::fs::read_to_string(&key).unwrap();
    let key_body = key_text.lines().nth(1).unwrap();
    assert!(!shown.contains(key_body), "the client key was shown");
    // Without a client certificate the server refuses.
    refused(&nats, &tls);
}
