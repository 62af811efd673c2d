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

/// What the validator catches that the engine would only meet at run time: a guard that can
/// never be a boolean (an error), a guard left to the data (a warning), a duration written
/// as text where milliseconds are wanted (an error giving the number to write), and, in a
/// test file, a misspelt result kind (an error naming its line) — each with file, line and
/// column.
#[test]
fn guards_durations_and_result_kinds_are_checked_where_they_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let saga = |guard: &str, delay: &str| {
        format!(
            r#"format: 1
sagas:
  - name: door
    version: 1
    triggers:
      - subject: "aggregate.Door.*"
        correlation: event.aggregate_id
        start: true
    initial_state: open
    states:
      open:
        on:
          Closed:
            - when: {guard}
              timers:
                - name: lock
                  delay_ms: {delay}
              goto: shut
      shut:
        on:
          timer.lock:
            - goto: locked
      locked:
        terminal: true
"#
        )
    };
    let validate = |name: &str, text: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let out = runner().arg("validate").arg(&path).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    let (code, err) = validate("sum.yaml", saga("\"state.count + 1\"", "60000"));
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("sum.yaml:14:21: error: guard `state.count + 1` gives arithmetic"),
        "{err}"
    );

    let (code, err) = validate("field.yaml", saga("state.ending", "60000"));
    assert_eq!(code, Some(0), "a warning does not fail validation: {err}");
    assert!(
        err.contains("field.yaml:14:21: warning: guard `state.ending` is true or false only if")
            && err.contains("`state.ending == true`"),
        "{err}"
    );

    let (code, err) = validate("fine.yaml", saga("\"has(event.payload.by)\"", "60000"));
    assert_eq!(code, Some(0), "{err}");
    assert!(!err.contains("guard"), "{err}");

    let (code, err) = validate("text.yaml", saga("\"true\"", "\"30m\""));
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("text.yaml:17:29: error:") && err.contains("write 1800000 for \"30m\""),
        "{err}"
    );

    // A misspelt result kind in a test file stops it, naming the line.
    std::fs::write(dir.path().join("door.yaml"), saga("\"true\"", "60000")).unwrap();
    let tests = dir.path().join("door.tests.yaml");
    std::fs::write(
        &tests,
        r#"tests:
  - name: a misspelt result
    steps:
      - event: { subject: "aggregate.Door.d1", event_type: Closed, aggregate_id: d1, aggregate_type: Door, payload: {} }
      - effect_result: { effect: charge_card, result: Succeded }
"#,
    )
    .unwrap();
    let out = runner()
        .arg("test")
        .arg(&tests)
        .arg(dir.path().join("door.yaml"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("door.tests.yaml:5:")
            && text.contains(
                "unknown variant `Succeded`, expected one of Succeeded, Failed, TimedOut"
            ),
        "{text}"
    );
}
