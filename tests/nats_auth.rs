//! Runner authenticates to NATS with each scheme a server configuration offers — user and
//! password (for a user of an account in the server's `accounts` block, with JetStream
//! enabled for that account), token, nkey, TLS verified against a CA and mutual TLS (a CA
//! and certificates made for the test with openssl), and a creds file against an
//! operator-mode server (operator, account and user JWTs made and signed by the test,
//! accounts preloaded into a memory resolver, JetStream enabled by the account's limits) —
//! and a wrong secret fails with a clear error that never contains the secret (for creds: a
//! user issued by an account the operator never signed, and a user JWT whose signature is
//! not its account's); neither do the logs, `/info` or `/metrics` of a running node show
//! the secret (nor, for creds, the user JWT). Real nats-server (configured by the test),
//! real binary.
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
    // The user lives in an account of the server's `accounts` block (JetStream enabled
    // there), not in the global `authorization` block.
    let nats = NatsServer::start_with(&format!(
        "accounts {{ APP {{ jetstream: enabled, \
         users = [ {{ user: alice, password: \"{secret}\" }} ] }} }}\n"
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

/// Base64url without padding, as JWTs are encoded.
fn b64url(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// A JWT as nats-io/jwt v2 writes one: base64url (no padding) of the header and of the
/// claims, and of the ed25519 signature of "header.claims" by `signer`. The claims get
/// `jti`, `iat`, `iss` (the signer), `sub`, `name`, and `nats` with its `type` and version 2.
fn signed_jwt(
    signer: &nkeys::KeyPair,
    subject: &str,
    name: &str,
    kind: &str,
    mut nats: serde_json::Value,
) -> String {
    nats["type"] = kind.into();
    nats["version"] = 2.into();
    let claims = serde_json::json!({
        "jti": uuid::Uuid::new_v4().simple().to_string().to_uppercase(),
        "iat": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs(),
        "iss": signer.public_key(),
        "sub": subject,
        "name": name,
        "nats": nats,
    });
    let head = b64url(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let signing_input = format!("{head}.{}", b64url(claims.to_string().as_bytes()));
    let signature = signer.sign(signing_input.as_bytes()).unwrap();
    format!("{signing_input}.{}", b64url(&signature))
}

/// An account JWT signed by `operator`, everything unlimited; JetStream enabled (unlimited)
/// when `jetstream` (the server refuses it on the system account).
fn account_jwt(
    operator: &nkeys::KeyPair,
    account: &nkeys::KeyPair,
    name: &str,
    jetstream: bool,
) -> String {
    let mut limits = serde_json::json!({
        "subs": -1, "data": -1, "payload": -1,
        "imports": -1, "exports": -1, "wildcards": true, "conn": -1, "leaf": -1,
    });
    if jetstream {
        for k in ["mem_storage", "disk_storage", "streams", "consumer"] {
            limits[k] = (-1).into();
        }
    }
    signed_jwt(
        operator,
        &account.public_key(),
        name,
        "account",
        serde_json::json!({ "limits": limits }),
    )
}

/// A user JWT for `user`, signed by `account`, with no permission or limit set.
fn user_jwt(account: &nkeys::KeyPair, user: &nkeys::KeyPair) -> String {
    let nats = serde_json::json!({ "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1 });
    signed_jwt(account, &user.public_key(), "runner", "user", nats)
}

/// A creds file as `nsc` writes one: the decorated user JWT, then the decorated seed.
fn creds(jwt: &str, seed: &str) -> String {
    format!(
        "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\
         NKEYs are sensitive and should be treated as secrets.\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n\
         *************************************************************\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creds_file_with_jwts_against_an_operator_mode_server() {
    let operator = nkeys::KeyPair::new_operator();
    // A system account, as an operator deployment has (without one the server warns); it
    // gets no JetStream: the server refuses to start with JetStream on the system account.
    let system = nkeys::KeyPair::new_account();
    let account = nkeys::KeyPair::new_account();
    let operator_jwt = signed_jwt(
        &operator,
        &operator.public_key(),
        "test-operator",
        "operator",
        serde_json::json!({ "system_account": system.public_key() }),
    );
    let nats = NatsServer::start_with(&format!(
        "operator: {operator_jwt}\n\
         system_account: {sys}\n\
         resolver: MEMORY\n\
         resolver_preload: {{\n  {sys}: {sys_jwt}\n  {app}: {app_jwt}\n}}\n",
        sys = system.public_key(),
        sys_jwt = account_jwt(&operator, &system, "SYS", false),
        app = account.public_key(),
        app_jwt = account_jwt(&operator, &account, "APP", true),
    ));
    let dir = tempfile::tempdir().unwrap();

    let user = nkeys::KeyPair::new_user();
    let seed = user.seed().unwrap();
    let jwt = user_jwt(&account, &user);
    let creds_file = dir.path().join("user.creds");
    std::fs::write(&creds_file, creds(&jwt, &seed)).unwrap();
    let shown = up_and_everything_shown(
        &nats,
        &[("RUNNER__NATS__CREDS_FILE", creds_file.to_str().unwrap())],
    )
    .await;
    assert!(!shown.contains(&seed), "the seed was shown");
    assert!(!shown.contains(&jwt), "the user JWT was shown");
    let (signed_part, jwt_signature) = jwt.rsplit_once('.').unwrap();
    assert!(
        !shown.contains(jwt_signature),
        "the user JWT's signature was shown"
    );

    // A user signed by an account key the operator never signed for: the server does not
    // know its issuer.
    let stranger = nkeys::KeyPair::new_account();
    let other = nkeys::KeyPair::new_user();
    let other_seed = other.seed().unwrap();
    let wrong_file = dir.path().join("wrong-account.creds");
    std::fs::write(
        &wrong_file,
        creds(&user_jwt(&stranger, &other), &other_seed),
    )
    .unwrap();
    let out = refused(
        &nats,
        &[("RUNNER__NATS__CREDS_FILE", wrong_file.to_str().unwrap())],
    );
    assert!(out.contains("uthorization"), "{out}");
    assert!(!out.contains(&other_seed), "{out}");

    // The user's own JWT, naming the right account as its issuer, but signed by another
    // account key: the signature does not verify.
    let forged_signature = stranger.sign(signed_part.as_bytes()).unwrap();
    let forged = format!("{signed_part}.{}", b64url(&forged_signature));
    let forged_file = dir.path().join("forged.creds");
    std::fs::write(&forged_file, creds(&forged, &seed)).unwrap();
    let out = refused(
        &nats,
        &[("RUNNER__NATS__CREDS_FILE", forged_file.to_str().unwrap())],
    );
    assert!(out.contains("uthorization"), "{out}");
    assert!(!out.contains(&seed), "{out}");
}
