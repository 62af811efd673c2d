//! `runner replay`: what a manifest change would do to the instances a store holds, before it
//! is deployed. Each instance's recorded history (its transition ring, `storage/tables/
//! history.rs`) names the inputs it applied and where each came from; those inputs are read
//! again (stream messages by sequence from JetStream, timer firings rebuilt from their name,
//! id and due time, redriven letters from the store) and applied, from a blank instance, by
//! the pure engine twice: with the manifests in force (`--current`) and with the new ones
//! (`--manifest`). The first step at which the two decide differently — another state,
//! another command or event (subject or body), another timer set or cancelled, or an error on
//! one side only — is reported for that instance.
//!
//! Guarantees:
//! - **Nothing is written**: the store is opened read only (beside a live node), JetStream is
//!   only read.
//! - **Same inputs, same engine**: inputs are admitted as the worker admits them (with their
//!   stored time bounding their timestamps), so a replay with identical manifests reports no
//!   difference. A step where the current manifests do not reproduce what the history
//!   recorded (another state, another number of outputs) is reported as such: the manifests
//!   given as current are not the ones that ran.
//! - **Versions do not count as a change**: the saga version stamped into outputs
//!   (`saga_version`) is left out of the comparison, so a version bump alone diverges nothing.
//! - **What cannot be replayed is said, not guessed**: an instance whose ring no longer holds
//!   its first transition, or one of whose inputs is gone from its stream, is listed with the
//!   reason and skipped. Inputs that changed nothing (ignored by the current version) are not
//!   in the history, so a new version that would act on one is not seen.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value as Json;

use crate::manifest::Catalog;
use crate::saga::{self, Applied, Input, StepError};
use crate::storage::Store;
use crate::storage::tables::HistoryEntry;
use crate::worker::admission::{self, Limits, RawInput};

/// Which instances to replay.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// Only this tenant.
    pub tenant: Option<String>,
    /// Only this saga.
    pub saga: Option<String>,
    /// At most this many instances (0: all).
    pub limit: usize,
}

/// One instance where the new manifests decide differently.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Divergence {
    /// Tenant.
    pub tenant: String,
    /// Saga.
    pub saga: String,
    /// Correlation id.
    pub correlation_id: String,
    /// The step (the instance's applied-input counter) where they part.
    pub step: u64,
    /// The event of that step.
    pub event: String,
    /// Where its input came from.
    pub source: String,
    /// What differs, in words.
    pub what: String,
}

/// What a replay found.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    /// Instances replayed to their last recorded step.
    pub replayed: usize,
    /// Instances the new manifests would take elsewhere.
    pub diverged: Vec<Divergence>,
    /// Instances whose history the current manifests do not reproduce.
    pub not_reproduced: Vec<Divergence>,
    /// Instances that could not be replayed, with the reason.
    pub skipped: Vec<(String, String)>,
}

/// Where recorded inputs are read back from.
pub trait Inputs {
    /// The message stored at `seq` of `stream`: its subject, body and stored time (ms).
    fn message(&mut self, stream: &str, seq: u64) -> Result<(String, Vec<u8>, u64), String>;
}

/// Replays the instances of `store` picked by `pick` with `current` and `new`.
pub fn replay(
    store: &Store,
    inputs: &mut dyn Inputs,
    current: &Catalog,
    new: &Catalog,
    pick: &Selection,
) -> Result<Report, crate::storage::StorageError> {
    let instances = store.read_blocking(|t| t.instances())?;
    let mut report = Report::default();
    let mut seen = 0usize;
    for inst in instances {
        if pick.tenant.as_deref().is_some_and(|t| t != inst.tenant)
            || pick.saga.as_deref().is_some_and(|s| s != inst.saga)
        {
            continue;
        }
        if pick.limit > 0 && seen >= pick.limit {
            break;
        }
        seen += 1;
        let key = format!("{}/{}/{}", inst.tenant, inst.saga, inst.correlation_id);
        let (t, s, c) = (
            inst.tenant.clone(),
            inst.saga.clone(),
            inst.correlation_id.clone(),
        );
        let history = store.read_blocking(move |tx| tx.history(&t, &s, &c))?;
        match replay_one(store, inputs, current, new, &inst, &history) {
            Ok(None) => report.replayed += 1,
            Ok(Some(Found::Diverged(d))) => {
                report.replayed += 1;
                report.diverged.push(d);
            }
            Ok(Some(Found::NotReproduced(d))) => report.not_reproduced.push(d),
            Err(why) => report.skipped.push((key, why)),
        }
    }
    Ok(report)
}

enum Found {
    Diverged(Divergence),
    NotReproduced(Divergence),
}

fn replay_one(
    store: &Store,
    inputs: &mut dyn Inputs,
    current: &Catalog,
    new: &Catalog,
    inst: &saga::Instance,
    history: &[HistoryEntry],
) -> Result<Option<Found>, String> {
    match history.first() {
        None => return Err("no recorded transitions".into()),
        Some(h) if h.n != 1 => {
            return Err(format!(
                "its history keeps steps {} to {} only: the first ones are gone from the ring",
                h.n,
                history.last().map_or(h.n, |l| l.n)
            ));
        }
        Some(_) => {}
    }
    let limits = Limits::from_config(&crate::config::Config::default());
    let (mut now_inst, mut new_inst): (Option<saga::Instance>, Option<saga::Instance>) =
        (None, None);
    for h in history {
        let input = input_of(store, inputs, inst, h, &limits)?;
        let a = saga::apply(
            current,
            &inst.saga,
            &inst.correlation_id,
            now_inst.as_ref(),
            &input,
        );
        let b = saga::apply(
            new,
            &inst.saga,
            &inst.correlation_id,
            new_inst.as_ref(),
            &input,
        );
        let at = |what: String| Divergence {
            tenant: inst.tenant.clone(),
            saga: inst.saga.clone(),
            correlation_id: inst.correlation_id.clone(),
            step: h.n,
            event: h.event.clone(),
            source: h.source.clone(),
            what,
        };
        // The current manifests must decide what the history recorded.
        match &a {
            Ok(x) if x.instance.state != h.to || x.work.len() != h.emitted => {
                return Ok(Some(Found::NotReproduced(at(format!(
                    "recorded `{}` → `{}` with {} output(s); the current manifests give `{}` with {}",
                    h.from,
                    h.to,
                    h.emitted,
                    x.instance.state,
                    x.work.len()
                )))));
            }
            Ok(_) => {}
            Err(e) => {
                return Ok(Some(Found::NotReproduced(at(format!(
                    "recorded `{}` → `{}`; the current manifests refuse it: {e}",
                    h.from, h.to
                )))));
            }
        }
        if let Some(what) = difference(&a, &b) {
            return Ok(Some(Found::Diverged(at(what))));
        }
        now_inst = a.ok().map(|x| x.instance);
        new_inst = b.ok().map(|x| x.instance);
    }
    Ok(None)
}

/// The input of history entry `h` of `inst`, as the worker admitted it.
fn input_of(
    store: &Store,
    inputs: &mut dyn Inputs,
    inst: &saga::Instance,
    h: &HistoryEntry,
    limits: &Limits,
) -> Result<Input, String> {
    if h.source == "timer" {
        let name = h.event.strip_prefix("timer.").unwrap_or(&h.event);
        return Ok(Input::timer(
            &inst.tenant,
            &inst.saga,
            &inst.correlation_id,
            name,
            &h.event_id,
            h.at_ms,
        ));
    }
    let (subject, body, stored_ms) = if let Some(id) = h.source.strip_prefix("redrive:") {
        let id: u64 = id
            .parse()
            .map_err(|_| format!("step {}: source {:?}", h.n, h.source))?;
        let tenant = inst.tenant.clone();
        let letter = store
            .read_blocking(move |t| t.dead_letter(&tenant, id))
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("step {}: dead letter {id} is gone", h.n))?;
        (letter.subject, letter.body.into_bytes(), letter.stored_ms)
    } else {
        let (stream, seq) = h
            .source
            .rsplit_once(':')
            .and_then(|(s, q)| Some((s, q.parse::<u64>().ok()?)))
            .ok_or_else(|| format!("step {}: no way to read source {:?}", h.n, h.source))?;
        let (subject, body, stored_ms) = inputs
            .message(stream, seq)
            .map_err(|e| format!("step {}: {}: {e}", h.n, h.source))?;
        (subject, body, Some(stored_ms))
    };
    let raw = RawInput {
        subject,
        body: body.into(),
        traceparent: None,
        header_bytes: 0,
        refused: None,
        live_cap: None,
        timer_cap: None,
        source: h.source.clone(),
        stored_ms,
    };
    admission::admit(&raw, limits)
        .map(|a| a.input)
        .map_err(|r| format!("step {}: refused at admission: {}", h.n, r.reason))
}

/// The first way `b` decides differently from `a`, in words; `None` when they agree.
fn difference(a: &Result<Applied, StepError>, b: &Result<Applied, StepError>) -> Option<String> {
    let (a, b) = match (a, b) {
        (Ok(a), Ok(b)) => (a, b),
        (Ok(_), Err(e)) => return Some(format!("the new manifests refuse the input: {e}")),
        (Err(_), Ok(b)) => {
            return Some(format!(
                "the new manifests apply an input the current ones refuse (to `{}`)",
                b.instance.state
            ));
        }
        (Err(_), Err(_)) => return None,
    };
    if a.instance.state != b.instance.state {
        return Some(format!(
            "state: now `{}`, new `{}`",
            a.instance.state, b.instance.state
        ));
    }
    let work = |x: &Applied| -> Vec<(String, Json)> {
        x.work
            .iter()
            .chain(x.finished.iter())
            .map(|w| (w.subject.clone(), without_version(w.body.json().clone())))
            .collect()
    };
    let (wa, wb) = (work(a), work(b));
    if wa != wb {
        let n = wa.iter().zip(&wb).take_while(|(x, y)| x == y).count();
        return Some(match (wa.get(n), wb.get(n)) {
            (Some(x), Some(y)) if x.0 != y.0 => {
                format!("output {}: now `{}`, new `{}`", n + 1, x.0, y.0)
            }
            (Some(x), Some(_)) => format!("output {} (`{}`): another body", n + 1, x.0),
            (Some(x), None) => format!("output {}: now `{}`, new none", n + 1, x.0),
            (None, Some(y)) => format!("output {}: now none, new `{}`", n + 1, y.0),
            (None, None) => "outputs differ".into(),
        });
    }
    let timers = |x: &Applied| -> BTreeMap<String, u64> {
        x.timers_set
            .iter()
            .map(|t| (t.name.clone(), t.due_ms))
            .collect()
    };
    if timers(a) != timers(b) {
        return Some(format!(
            "timers set: now {:?}, new {:?}",
            timers(a),
            timers(b)
        ));
    }
    let cancelled = |x: &Applied| -> Vec<String> {
        x.timers_cancelled.iter().map(|t| t.name.clone()).collect()
    };
    if cancelled(a) != cancelled(b) {
        return Some(format!(
            "timers cancelled: now {:?}, new {:?}",
            cancelled(a),
            cancelled(b)
        ));
    }
    None
}

/// `body` without the `saga_version` it carries (in `metadata`, and in a terminal event's
/// payload): a version bump alone is not a different decision.
fn without_version(mut body: Json) -> Json {
    for part in ["metadata", "payload"] {
        if let Some(m) = body.get_mut(part).and_then(Json::as_object_mut) {
            m.remove("saga_version");
        }
    }
    body
}
