//! `runner graph`, the real binary: every shipped saga drawn in both formats is accepted by
//! the real parsers (Graphviz's `dot`, and Mermaid's own parser in Node through
//! `tests/tools/mermaid-parse.mjs`; `scripts/setup-deps --test` installs both), with every
//! state and every transition drawn; labels built from hostile guards stay inside their
//! labels; an unknown saga and an invalid manifest are refused with a clear message. That
//! the output is stable is checked by the book's generated page (`tests/book`).
#![allow(clippy::unwrap_used)]

mod common;

use std::io::Write as _;
use std::process::{Command, Output, Stdio};

use common::{repo_root, runner_bin};

fn graph(args: &[&str]) -> Output {
    Command::new(runner_bin())
        .arg("graph")
        .args(args)
        .current_dir(repo_root())
        .output()
        .unwrap()
}

/// Runs `program args` with `input` on stdin; its output, failing the test when it fails.
fn feed(program: &str, args: &[&str], input: &[u8]) -> String {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{program}: {e} (scripts/setup-deps --test installs it)"));
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{program} refused the diagram: {text}\n{}\n--- input ---\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(input)
    );
    text
}

/// Parses Mermaid text with Mermaid's parser; the number of diagrams it accepted.
fn mermaid_parses(text: &[u8]) -> usize {
    let modules = std::env::var("RUNNER_MERMAID_MODULES").unwrap_or_else(|_| {
        repo_root()
            .join("target/tools/mermaid/node_modules")
            .display()
            .to_string()
    });
    let script = repo_root().join("tests/tools/mermaid-parse.mjs");
    let out = feed("node", &[script.to_str().unwrap(), &modules], text);
    out.lines().filter(|l| *l == "ok").count()
}

/// The edges and node labels of a DOT text, as `dot -Tjson` reads them.
fn dot_parses(text: &[u8]) -> (usize, Vec<String>) {
    let json: serde_json::Value = serde_json::from_str(&feed("dot", &["-Tjson"], text)).unwrap();
    let edges = json["edges"].as_array().map_or(0, Vec::len);
    let labels = json["objects"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o["label"].as_str().map(str::to_string))
        .collect();
    (edges, labels)
}

#[test]
fn every_shipped_saga_draws_as_valid_mermaid_and_dot_with_every_state() {
    let mermaid = graph(&["manifests/"]);
    assert!(mermaid.status.success(), "{mermaid:?}");
    let sagas = String::from_utf8_lossy(&mermaid.stdout)
        .matches("stateDiagram-v2")
        .count();
    assert!(sagas >= 4, "{sagas} sagas drawn");
    assert_eq!(mermaid_parses(&mermaid.stdout), sagas);

    for (file, saga, states) in [
        (
            "manifests/order.yaml",
            "order",
            &[
                "new",
                "awaiting_payment",
                "reserving_stock",
                "shipping",
                "shipped",
                "refunding",
                "cancelled",
            ][..],
        ),
        (
            "manifests/travel.yaml",
            "travel_booking",
            &[
                "step:flight",
                "step:hotel+car",
                "completed",
                "compensating:flight",
                "compensated",
                "needs_operator",
            ][..],
        ),
    ] {
        let dot = graph(&[file, "--saga", saga, "--format", "dot"]);
        assert!(dot.status.success(), "{dot:?}");
        let (edges, labels) = dot_parses(&dot.stdout);
        for s in states {
            assert!(
                labels.iter().any(|l| l == s),
                "{saga}: no state {s} in {labels:?}"
            );
        }
        let mermaid = graph(&[file, "--saga", saga]);
        let text = String::from_utf8_lossy(&mermaid.stdout);
        let arrows = text
            .lines()
            .filter(|l| l.contains(" --> ") && !l.contains("[*]"))
            .count();
        // DOT draws the start as an edge from a point; Mermaid as `[*] -->`.
        assert_eq!(
            arrows + 1,
            edges,
            "{saga}: the same transitions in both formats"
        );
    }
}

#[test]
fn hostile_guards_and_names_stay_inside_their_labels() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hostile.yaml");
    std::fs::write(
        &path,
        r#"
format: 1
sagas:
  - name: hostile
    version: 1
    triggers:
      - subject: "aggregate.Thing.*"
        correlation: event.aggregate_id
        start: true
    initial_state: new
    states:
      new:
        on:
          ThingHappened:
            - when: 'event.payload.note == "a\"; b --> c } ] %% # <x> | (y)"'
              goto: done
            - when: "event.payload.n >= 2 && event.payload.n < 5"
              emit:
                - event: { event_type: "Odd", payload: { note: "x" } }
              goto: done
      done:
        terminal: true
        outcome: failed
"#,
    )
    .unwrap();
    let file = path.to_str().unwrap();
    let mermaid = graph(&[file]);
    assert!(mermaid.status.success(), "{mermaid:?}");
    assert_eq!(mermaid_parses(&mermaid.stdout), 1);
    let text = String::from_utf8_lossy(&mermaid.stdout);
    assert_eq!(
        text.lines().filter(|l| l.contains("s1 --> s0 : ")).count(),
        2,
        "both transitions drawn, each on one line: {text}"
    );
    let dot = graph(&[file, "--format", "dot"]);
    let (edges, labels) = dot_parses(&dot.stdout);
    assert_eq!(edges, 3, "start arrow and two transitions: {labels:?}");
    let dot_text = String::from_utf8_lossy(&dot.stdout);
    assert!(
        dot_text.contains(r#"[event.payload.note == \"a\\\"; b --> c } ] %% # <x> | (y)\"]"#),
        "the guard is shown whole: {dot_text}"
    );
}

#[test]
fn an_unknown_saga_and_an_invalid_manifest_are_refused_clearly() {
    let out = graph(&["manifests/order.yaml", "--saga", "nope"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no saga nope") && err.contains("order v1"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "format: 1\nsagas:\n  - name: x\n    version: one\n").unwrap();
    let out = graph(&[bad.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.yaml:4"), "names file and line: {err}");
    assert!(err.contains("nothing drawn"), "{err}");
}
