//! The postgres provider over TLS: `sslmode=require` connects with rustls and verifies the
//! server against `tls_ca_file` (a CA made for the test); a server the roots do not vouch for
//! is never talked to; `sslmode=disable` stays plain. What the server saw is read back from
//! `pg_stat_ssl` by the statement itself. Real PostgreSQL, real nats-server, real binary.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::effects::{EffectBed, command, one_per_command};
use common::postgres::PgServer;
use common::run_to_exit;
use common::upstream::Reply;

fn effect(name: &str, dsn_env: &str, ca: Option<&str>) -> String {
    let ca = ca.map_or(String::new(), |c| format!("\n      tls_ca_file: \"{c}\""));
    format!(
        r#"  - name: {name}
    provider: postgres
    settings:
      url: "${{ saga.secrets.dsn }}"
      secrets: {{ dsn: {{ env: {dsn_env} }} }}
      statement: "INSERT INTO seen SELECT $1, $2, ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
      params: ["${{ event.command_id }}", "{name}"]{ca}
    retry: {{ retry_limit: 1, base_backoff: 10 }}
    timeout_ms: 5000
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_verifies_the_server_and_disable_stays_plain() {
    let pg = PgServer::start_tls();
    let ca = pg.ca_file.clone().unwrap();
    let client = pg.client().await;
    client
        .batch_execute("CREATE TABLE seen (command_id text PRIMARY KEY, effect text, ssl bool)")
        .await
        .unwrap();
    let ca_s = ca.to_str().unwrap().to_owned();
    let bed = EffectBed::start(Arc::new(|_, _, _| Reply::status(404)), |_| {
        format!(
            "format: 1\neffects:\n{}{}{}",
            effect("verified", "TEST_PG_TLS", Some(&ca_s)),
            effect("unverified", "TEST_PG_TLS", None),
            effect("plain", "TEST_PG_PLAIN", None),
        )
    })
    .await;
    let tls_dsn = format!("{} sslmode=require", pg.url());
    let plain_dsn = format!("{} sslmode=disable", pg.url());
    let _w = bed.runner(&[
        ("TEST_PG_TLS", tls_dsn.as_str()),
        ("TEST_PG_PLAIN", plain_dsn.as_str()),
    ]);
    let ids = bed
        .publish(&[
            command("verified", 1),
            command("unverified", 2),
            command("plain", 3),
        ])
        .await;
    let seen = bed.settle(3, Duration::from_secs(60)).await;
    let by = one_per_command(&seen);
    assert_eq!(by[&ids[0]]["result_type"], "Succeeded", "{}", by[&ids[0]]);
    assert_eq!(by[&ids[2]]["result_type"], "Succeeded", "{}", by[&ids[2]]);
    let refused = &by[&ids[1]];
    assert_eq!(refused["result_type"], "Failed", "{refused}");
    assert!(
        refused.to_string().contains("cannot connect"),
        "an unverified server is a connection failure: {refused}"
    );
    assert!(
        !refused.to_string().contains("port="),
        "no connection string: {refused}"
    );
    let rows = client
        .query("SELECT effect, ssl FROM seen ORDER BY effect", &[])
        .await
        .unwrap();
    let got: Vec<(String, bool)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(
        got,
        vec![("plain".to_string(), false), ("verified".to_string(), true)],
        "the verified effect's session was encrypted, the plain one was not, the \
         unverified one never reached the server"
    );
}

#[test]
fn a_missing_ca_file_is_a_manifest_error_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("effects.yaml");
    std::fs::write(
        &path,
        format!(
            "format: 1\neffects:\n{}",
            effect("verified", "X", Some("/nonexistent/ca.pem"))
        ),
    )
    .unwrap();
    let (code, out) = run_to_exit(
        &["validate", path.to_str().unwrap()],
        &[],
        Duration::from_secs(20),
    );
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("tls_ca_file"), "{out}");
    assert!(out.contains("/nonexistent/ca.pem"), "{out}");
}
