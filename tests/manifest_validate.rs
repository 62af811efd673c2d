//! `runner validate` behaviour: the shipped manifests are clean and pass their scenarios, and
//! a collection of broken manifests produces exactly the expected located messages.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use runner::manifest::{self, Severity, collect_files, is_test_file};
use runner::saga::scenario;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn shipped_manifests_are_valid_without_warnings() {
    let report = manifest::load(&[root().join("manifests")]);
    let diags: Vec<String> = report.diagnostics.iter().map(ToString::to_string).collect();
    assert!(diags.is_empty(), "{diags:#?}");
    let catalog = report.catalog.expect("catalog");
    let summary = catalog.summary();
    let names: Vec<&str> = summary.sagas.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["loan", "order", "subscription_renewal", "travel_booking"]
    );
    assert!(summary.effects.contains(&"charge_card".to_string()));
}

#[test]
fn shipped_scenarios_pass() {
    let dir = root().join("manifests");
    let catalog = manifest::load(std::slice::from_ref(&dir))
        .catalog
        .expect("catalog");
    let mut ran = 0;
    for file in collect_files(&[dir])
        .unwrap()
        .iter()
        .filter(|f| is_test_file(f))
    {
        let text = std::fs::read_to_string(file).unwrap();
        let parsed = scenario::parse(file, &text).unwrap();
        for r in scenario::run_file(&catalog, file, &parsed) {
            assert!(
                r.passed(),
                "{}: {}\n{}",
                r.file,
                r.name,
                r.failures.join("\n")
            );
            ran += 1;
        }
    }
    assert!(ran >= 10, "only {ran} scenarios ran");
}

/// Snapshot: every problem in `tests/broken/`, each with file:line:col. To accept a change,
/// regenerate with `cargo run -- validate tests/broken 2>&1 | head -n -1 > tests/broken/expected.txt`.
#[test]
fn broken_manifests_report_every_problem_with_locations() {
    let dir = root().join("tests/broken");
    let report = manifest::load(std::slice::from_ref(&dir));
    assert!(report.catalog.is_none());
    let got: Vec<String> = report
        .diagnostics
        .iter()
        .map(|d| {
            let mut d = d.clone();
            d.file = Path::new("tests/broken").join(d.file.strip_prefix(&dir).unwrap());
            d.to_string()
        })
        .collect();
    let want = std::fs::read_to_string(dir.join("expected.txt")).unwrap();
    let want: Vec<&str> = want.lines().collect();
    assert_eq!(
        got, want,
        "diagnostics changed; see the regenerate command in this test's doc"
    );
    // Both severities are present and every diagnostic is located.
    assert!(
        report
            .diagnostics
            .iter()
            .any(|d| d.severity == Severity::Warning)
    );
    assert!(
        report
            .diagnostics
            .iter()
            .all(|d| d.line > 0 && d.column > 0)
    );
}

#[test]
fn test_files_are_not_read_as_manifests() {
    let files = collect_files(&[root().join("manifests")]).unwrap();
    assert!(files.iter().any(|f| is_test_file(f)));
    let report = manifest::load(&[root().join("manifests/order.tests.yaml")]);
    assert!(report.catalog.is_some());
    assert!(report.catalog.unwrap().summary().sagas.is_empty());
}

#[test]
fn runtime_map_iteration_in_a_transition_is_poison() {
    let src = r#"
format: 1
sagas:
  - name: s
    version: 1
    triggers: [{ subject: aggregate.A.*, correlation: event.aggregate_id, start: true }]
    initial_state: a
    states:
      a:
        on:
          Go: { set: { keys: "${ event.payload.m.map(k, k) }" }, goto: b }
      b: { terminal: true }
"#;
    let catalog = manifest::load_str(&[("s.yaml", src)]).catalog.unwrap();
    let input = runner::saga::Input::new(
        "aggregate.A.a1",
        serde_json::json!({"v":1,"event_id":"e","tenant_id":"t","event_type":"Go","aggregate_id":"a1",
            "timestamp_ms":1,"payload":{"m":{"x":1,"y":2}}}),
    );
    let err = runner::saga::apply(&catalog, "s", "a1", None, &input).unwrap_err();
    assert!(
        matches!(err, runner::saga::StepError::Poison { .. }),
        "{err:?}"
    );
}

#[test]
fn catalog_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<manifest::Catalog>();
    assert_send_sync::<runner::saga::Applied>();
    let catalog = std::sync::Arc::new(manifest::load(&[root().join("manifests")]).catalog.unwrap());
    let c2 = catalog.clone();
    let names = std::thread::spawn(move || c2.saga_names().count())
        .join()
        .unwrap();
    assert_eq!(names, catalog.saga_names().count());
}
