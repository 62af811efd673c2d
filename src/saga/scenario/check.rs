//! Comparing what a scenario step did with what it expects: the outcome, the instance
//! (state, status, data), the work emitted, the timers set and cancelled, the terminal event.
//!
//! Guarantee: every expectation given is checked and every difference is reported (a step
//! does not stop at its first difference); what is not given is not checked.

use std::fmt::Write as _;

use serde_json::Value as Json;

use super::{Expect, ExpectTimer, ExpectWork};
use crate::saga::types::{Applied, Instance, WorkItem};

pub(super) fn check_outcome(
    failures: &mut Vec<String>,
    label: &str,
    e: &Expect,
    got: &str,
    detail: &str,
) {
    let want = e.outcome.as_deref().unwrap_or("applied");
    if want != got {
        let detail = if detail.is_empty() {
            String::new()
        } else {
            format!(" ({detail})")
        };
        failures.push(format!(
            "{label}: outcome: expected `{want}`, got `{got}`{detail}"
        ));
    }
}

pub(super) fn check_expect(
    failures: &mut Vec<String>,
    label: &str,
    e: &Expect,
    (inst, applied): (Option<&Instance>, Option<&Applied>),
    input_ms: u64,
) {
    if let Some(want) = &e.state {
        let got = inst.map(|i| i.state.as_str()).unwrap_or("<no instance>");
        if want != got {
            failures.push(format!("{label}: state: expected `{want}`, got `{got}`"));
        }
    }
    if let Some(want) = e.status {
        match inst {
            Some(i) if i.status == want => {}
            Some(i) => failures.push(format!(
                "{label}: status: expected {want:?}, got {:?}",
                i.status
            )),
            None => failures.push(format!(
                "{label}: status: expected {want:?}, got no instance"
            )),
        }
    }
    if let Some(want) = &e.data {
        let got = inst.map(|i| i.data.clone()).unwrap_or(Json::Null);
        diff_json(failures, &format!("{label}: data"), want, &got);
    }
    let empty = Vec::new();
    let work = applied.map(|a| &a.work).unwrap_or(&empty);
    if let Some(want) = &e.work {
        if want.len() != work.len() {
            let mut msg = format!(
                "{label}: work: expected {} item(s), got {}:",
                want.len(),
                work.len()
            );
            for w in work {
                let _ = write!(msg, "\n      {} {}", w.subject, w.body);
            }
            failures.push(msg);
        } else {
            for (n, (w, got)) in want.iter().zip(work).enumerate() {
                match_work(failures, &format!("{label}: work[{n}]"), w, got);
            }
        }
    }
    if let Some(want) = &e.finished_event {
        let got = applied.and_then(|a| a.finished.as_ref());
        let at = format!("{label}: finished_event");
        match (want, got) {
            (Some(w), Some(got)) => match_work(failures, &at, w, got),
            (None, None) => {}
            (Some(_), None) => failures.push(format!("{at}: expected one, got none")),
            (None, Some(got)) => failures.push(format!(
                "{at}: expected none, got {}",
                got.body["event_type"]
            )),
        }
    }
    let names = |v: Option<Vec<String>>| v.unwrap_or_default();
    if let Some(want) = &e.timers_set {
        let set = applied.map(|a| a.timers_set.as_slice()).unwrap_or_default();
        let got: Vec<&str> = set.iter().map(|t| t.name.as_str()).collect();
        let wanted: Vec<&str> = want.iter().map(ExpectTimer::name).collect();
        if wanted != got {
            failures.push(format!(
                "{label}: timers_set: expected {wanted:?}, got {got:?}"
            ));
        } else {
            for (w, t) in want.iter().zip(set) {
                if let ExpectTimer::Due(d) = w {
                    let after = t.due_ms.saturating_sub(input_ms);
                    if after != d.after_ms {
                        failures.push(format!(
                            "{label}: timers_set: `{}` is due {after} ms after the input, \
                             expected {}",
                            d.name, d.after_ms
                        ));
                    }
                }
            }
        }
    }
    if let Some(want) = &e.timers_cancelled {
        let got =
            names(applied.map(|a| a.timers_cancelled.iter().map(|t| t.name.clone()).collect()));
        if *want != got {
            failures.push(format!(
                "{label}: timers_cancelled: expected {want:?}, got {got:?}"
            ));
        }
    }
}

/// Compares one output with its expectation (kind, subject with an optional trailing `*`,
/// partial body).
fn match_work(failures: &mut Vec<String>, at: &str, w: &ExpectWork, got: &WorkItem) {
    if let Some(k) = w.kind
        && k != got.kind
    {
        failures.push(format!("{at}.kind: expected {k:?}, got {:?}", got.kind));
    }
    if let Some(s) = &w.subject {
        let ok = match s.strip_suffix('*') {
            Some(prefix) => got.subject.starts_with(prefix),
            None => *s == got.subject,
        };
        if !ok {
            failures.push(format!(
                "{at}.subject: expected `{s}`, got `{}`",
                got.subject
            ));
        }
    }
    if let Some(b) = &w.body {
        diff_json(failures, &format!("{at}.body"), b, got.body.json());
    }
}

/// Partial JSON comparison: every field of `want` must be in `got` and equal.
fn diff_json(failures: &mut Vec<String>, path: &str, want: &Json, got: &Json) {
    match (want, got) {
        (Json::Object(w), Json::Object(g)) => {
            for (k, wv) in w {
                match g.get(k) {
                    Some(gv) => diff_json(failures, &format!("{path}.{k}"), wv, gv),
                    None => failures.push(format!("{path}.{k}: expected {wv}, missing")),
                }
            }
        }
        (Json::Array(w), Json::Array(g)) if w.len() == g.len() => {
            for (n, (wv, gv)) in w.iter().zip(g).enumerate() {
                diff_json(failures, &format!("{path}[{n}]"), wv, gv);
            }
        }
        (Json::Number(a), Json::Number(b)) if a.as_f64() == b.as_f64() => {}
        _ if want == got => {}
        _ => failures.push(format!("{path}: expected {want}, got {got}")),
    }
}
