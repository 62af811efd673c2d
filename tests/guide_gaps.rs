//! The program gaps issue 16 found while writing the user guide, each shown fixed with the
//! real binary: `runner test` given only a tests file, `runner validate` and undeclared
//! secrets, firing a cancelled timer in a scenario (and the scenario doc comment that shows
//! it), and effect names that are not subject tokens.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Output};

fn runner(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_runner"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn a_tests_file_alone_finds_its_manifest_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["loan.yaml", "loan.tests.yaml"] {
        std::fs::copy(repo().join("manifests").join(f), dir.path().join(f)).unwrap();
    }
    let out = runner(dir.path(), &["test", "loan.tests.yaml"]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(all.contains("10 passed, 0 failed"), "{all}");
    assert!(!all.contains("no saga wants this input"), "{all}");
}

#[test]
fn a_tests_file_without_a_manifest_says_that_none_was_loaded() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        repo().join("manifests/loan.tests.yaml"),
        dir.path().join("other.tests.yaml"),
    )
    .unwrap();
    let out = runner(dir.path(), &["test", "other.tests.yaml"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(
        all.contains("no manifest was loaded: no saga is declared under other.tests.yaml"),
        "{all}"
    );
    assert!(!all.contains("no saga wants this input"), "{all}");
    assert!(!all.contains("passed"), "no test may run: {all}");
    // Naming the manifest as well runs them.
    std::fs::copy(
        repo().join("manifests/loan.yaml"),
        dir.path().join("loan.yaml"),
    )
    .unwrap();
    let out = runner(dir.path(), &["test", "other.tests.yaml", "loan.yaml"]);
    assert!(out.status.success(), "{}", text(&out));
}

const EFFECT: &str = "format: 1
effects:
  - name: score
    provider: http
    settings:
      url: \"https://bureau.example/${ saga.secrets.path }/scores\"
      headers:
        Authorization: \"Bearer ${ saga.secrets.TOKEN_REF }\"
      success_when: state.status == 200 && saga.secrets.flag == 'on'
      secrets:
        path: { env: BUREAU_PATH }
        token: { env: BUREAU_TOKEN }
";

#[test]
fn validate_rejects_a_reference_to_an_undeclared_secret_at_its_setting() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("e.yaml"),
        EFFECT.replace("TOKEN_REF", "nope"),
    )
    .unwrap();
    let out = runner(dir.path(), &["validate", "e.yaml"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    // Each undeclared one, at the line of its setting, with the declared ones named.
    assert!(
        all.contains(
            "e.yaml:8:9: error: effect `score`: setting `headers.Authorization` reads \
             `saga.secrets.nope`, which the effect does not declare (declared: path, token)"
        ),
        "{all}"
    );
    assert!(
        all.contains(
            "e.yaml:9:7: error: effect `score`: setting `success_when` reads `saga.secrets.flag`"
        ),
        "{all}"
    );
    assert!(all.contains("2 error(s)"), "{all}");
    // Declared everywhere: accepted (a secret inside the URL included).
    let fixed = EFFECT.replace("TOKEN_REF", "token").replace(
        "token: { env: BUREAU_TOKEN }",
        "token: { env: BUREAU_TOKEN }\n        flag: { file: /run/flag }",
    );
    std::fs::write(dir.path().join("e.yaml"), fixed).unwrap();
    let out = runner(dir.path(), &["validate", "e.yaml"]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn an_effect_without_secrets_that_reads_one_is_told_none_is_declared() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("e.yaml"),
        "format: 1\neffects:\n  - name: n\n    provider: nats_publish\n    settings:\n      subject: \"tenant.t.${ saga.secrets.s }\"\n",
    )
    .unwrap();
    let out = runner(dir.path(), &["validate", "e.yaml"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(
        all.contains("e.yaml:6:7:") && all.contains("(none is declared)"),
        "{all}"
    );
}

#[test]
fn a_cancelled_timer_can_be_fired_in_a_scenario_and_is_ignored() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        repo().join("manifests/order.yaml"),
        dir.path().join("order.yaml"),
    )
    .unwrap();
    // The example of the scenario module's doc comment, taken from the source as written.
    let source = std::fs::read_to_string(repo().join("src/saga/scenario.rs")).unwrap();
    let start = source.find("//! ```yaml\n").expect("the doc example") + "//! ```yaml\n".len();
    let end = start + source[start..].find("//! ```\n").unwrap();
    let example: String = source[start..end]
        .lines()
        .map(|l| {
            l.strip_prefix("//! ")
                .unwrap_or(l.trim_start_matches("//!"))
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert!(example.contains("fire_timer: payment_timeout"), "{example}");
    assert!(example.contains("outcome: stale_timer"), "{example}");
    std::fs::write(dir.path().join("order.tests.yaml"), example).unwrap();
    let out = runner(dir.path(), &["test", "order.tests.yaml"]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(all.contains("1 passed, 0 failed"), "{all}");

    // A timer the test never set is still an error of the test, named as such.
    std::fs::write(
        dir.path().join("order.tests.yaml"),
        "format: 1\ntests:\n  - name: t\n    steps:\n      - event: { subject: aggregate.Order.o-1, event_type: OrderPlaced, payload: { customer_id: c, amount_cents: 5, items: [{ sku: a, qty: 1 }] } }\n      - fire_timer: no_such_timer\n",
    )
    .unwrap();
    let out = runner(dir.path(), &["test", "order.tests.yaml"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(
        all.contains("step 2: timer `no_such_timer` was never set on this instance (pending: [\"payment_timeout\"])"),
        "{all}"
    );
}

#[test]
fn a_timer_fired_again_after_the_instance_ended_is_finished() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("t.yaml"),
        "format: 1
sagas:
  - name: t
    version: 1
    triggers: [{ subject: aggregate.T.*, correlation: event.aggregate_id, start: true }]
    initial_state: s
    states:
      s:
        on:
          Go: { timers: [{ name: tick, delay_ms: 1000 }], goto: waiting }
      waiting:
        on:
          timer.tick: { goto: done }
      done: { terminal: true }
",
    )
    .unwrap();
    // Cancelled by a terminal state: fired late, the instance has finished.
    std::fs::write(
        dir.path().join("t.tests.yaml"),
        "format: 1
tests:
  - name: fired, then fired again late
    steps:
      - event: { subject: aggregate.T.a, event_type: Go }
        expect: { timers_set: [tick] }
      - fire_timer: tick
        expect: { state: done }
      - fire_timer: tick
        expect: { outcome: finished }
",
    )
    .unwrap();
    let out = runner(dir.path(), &["test", "t.tests.yaml"]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn an_effect_name_that_is_not_a_subject_token_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("e.yaml"),
        "format: 1\neffects:\n  - name: credit.check\n    provider: noop\n",
    )
    .unwrap();
    let out = runner(dir.path(), &["validate", "e.yaml"]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(
        all.contains("e.yaml:3:11: error: effect name `credit.check` is not a valid subject token"),
        "{all}"
    );
}
