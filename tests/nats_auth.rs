//! Runner authenticates to NATS with each scheme a plain server configuration offers —
//! user and password, token, nkey — and a wrong secret fails with a clear error that never
//! contains the secret; neither do the logs, `/info` or `/metrics` of a running node. Real
//! nats-server (configured by the test), real binary.
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
