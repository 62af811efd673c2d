//! The `runner validate` and `runner test` commands, run as the binary: output and exit codes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;

fn runner() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_runner"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c
}

#[test]
fn validate_and_test_pass_on_the_shipped_manifests() {
    let out = runner().args(["validate", "manifests/"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = runner().args(["test", "manifests/"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout
            .lines()
            .last()
            .unwrap()
            .ends_with(" passed, 0 failed"),
        "{stdout}"
    );
}

#[test]
fn validate_against_a_data_dir_without_a_store_says_so_and_creates_none() {
    let dir = tempfile::tempdir().unwrap();
    let out = runner()
        .args(["validate", "--data-dir"])
        .arg(dir.path())
        .arg("manifests/")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("cannot read the store in") && stderr.contains(": no store in "),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "nothing created"
    );
}

#[test]
fn validate_fails_with_located_errors() {
    let out = runner()
        .args(["validate", "tests/broken"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("tests/broken/semantic.yaml:29:19: error: unknown state `wating`"),
        "{stderr}"
    );
}

#[test]
fn wrong_provider_settings_are_manifest_errors_at_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("e.yaml"),
        "format: 1\neffects:\n  - name: pay\n    provider: http\n    settings: { method: POST }\n  - name: rec\n    provider: postgres\n    settings: { url: \"host=db\", statement: \"INSERT ${ x }\" }\n  - name: ok\n    provider: noop\n",
    )
    .unwrap();
    let out = runner().arg("validate").arg(dir.path()).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("e.yaml:3:11: error: effect `pay`: setting `url`"),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "e.yaml:8:33: error: effect `rec`: setting `statement`: must not hold templates"
        ),
        "{stderr}"
    );
    assert!(stderr.contains("2 error(s)"), "{stderr}");
}

#[test]
fn warnings_alone_exit_zero() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("w.yaml"),
        "format: 1\nsagas:\n  - name: w\n    version: 1\n    triggers: [{ subject: aggregate.W.*, correlation: event.aggregate_id, start: true }]\n    initial_state: a\n    states:\n      a: { on: { Go: { goto: b } } }\n      b: { terminal: true }\n      orphan: { terminal: true }\n",
    )
    .unwrap();
    let out = runner().arg("validate").arg(dir.path()).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("w.yaml:10:7: warning: state `orphan` is unreachable from `a`"),
        "{stderr}"
    );
}

#[test]
fn a_failing_scenario_prints_a_readable_diff_and_exits_one() {
    let dir = tempfile::tempdir().unwrap();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    std::fs::copy(
        root.join("manifests/order.yaml"),
        dir.path().join("order.yaml"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("order.tests.yaml"),
        r#"format: 1
tests:
  - name: wrong expectations
    steps:
      - event:
          subject: aggregate.Order.o-1
          event_type: OrderPlaced
          payload: { customer_id: c, amount_cents: 5, items: [{ sku: a, qty: 1 }] }
        expect:
          state: paid
          work:
            - subject: effect.charge_card.*
              body: { payload: { amount_cents: 6 } }
  - name: right expectations
    steps:
      - event:
          subject: aggregate.Order.o-2
          event_type: OrderPlaced
          payload: { customer_id: c, amount_cents: 5, items: [{ sku: a, qty: 1 }] }
        expect: { state: awaiting_payment }
"#,
    )
    .unwrap();
    let out = runner().arg("test").arg(dir.path()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("FAILED"), "{stdout}");
    assert!(
        stdout.contains("step 1: state: expected `paid`, got `awaiting_payment`"),
        "{stdout}"
    );
    assert!(
        stdout.contains("step 1: work[0].body.payload.amount_cents: expected 6, got 5"),
        "{stdout}"
    );
    assert!(
        stdout.lines().last().unwrap() == "1 passed, 1 failed",
        "{stdout}"
    );
}
