//! A saga drawn as a state diagram (`runner graph`, the book's generated saga pages):
//! Mermaid `stateDiagram-v2` or Graphviz DOT, from a loaded saga of either style.
//!
//! Guarantees:
//! - **The engine's state names.** Nodes are named as instances' `state` reads: a state
//!   machine's own states; for an orchestration the states `saga/orchestrate.rs` moves
//!   through (`step:<name>`, `step:<a>+<b>` for a parallel group, `compensating:<name>`,
//!   `completed`, `compensated`, `needs_operator`). So a path an instance took (its history's
//!   `from`/`to`) can be laid over the drawing.
//! - **Everything a transition does is on its edge:** the event, the guard, what is emitted
//!   (effects, commands, events), timers set and cancelled. A transition that stays is a loop.
//! - **Stable output.** Same saga, same text: states and edges in a fixed order (a state
//!   machine's states and events by name, as the catalog keeps them; an orchestration's by
//!   declaration), node ids numbered in that order.
//! - **Valid text.** Labels are escaped for each format (Mermaid entity codes, DOT quoted
//!   strings); tests parse the shipped sagas' diagrams with Graphviz and Mermaid's own parser.
//!
//! An orchestration is drawn as declared: stages in order, and on a failure the
//! compensations of earlier steps in reverse declaration order (at run time they go in reverse
//! completion order, which is the same unless parallel steps finish out of order).

use std::fmt::Write as _;

use super::catalog::{Emit, Orchestration, Saga, SagaKind, TimerWhen, Transition};
use super::model::Outcome;

/// The output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Mermaid `stateDiagram-v2`.
    Mermaid,
    /// Graphviz DOT.
    Dot,
}

/// What a state is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Normal,
    Ends(Outcome),
    /// Waits for an operator (an orchestration's `needs_operator`).
    Parked,
}

/// A saga as states and labelled edges.
#[derive(Debug, Default)]
pub struct Diagram {
    title: String,
    initial: Option<usize>,
    states: Vec<(String, Kind)>,
    edges: Vec<(usize, usize, String)>,
}

impl Diagram {
    /// The diagram of `saga`.
    pub fn of(saga: &Saga) -> Self {
        let mut d = Diagram {
            title: format!("{} v{}", saga.name, saga.version),
            ..Default::default()
        };
        match &saga.kind {
            SagaKind::Machine(m) => {
                for (name, s) in &m.states {
                    d.state(name, s.terminal.map_or(Kind::Normal, Kind::Ends));
                }
                d.initial = d.find(&m.initial);
                for (name, s) in &m.states {
                    for (event, ts) in &s.on {
                        for t in ts {
                            let to = t.goto.as_deref().unwrap_or(name);
                            d.edge(name, to, transition_label(event, t));
                        }
                    }
                }
            }
            SagaKind::Steps(o) => orchestration(&mut d, o),
        }
        d
    }

    /// The names of the states, in drawing order.
    pub fn states(&self) -> impl Iterator<Item = &str> {
        self.states.iter().map(|(n, _)| n.as_str())
    }

    /// The diagram as text in `format`.
    pub fn render(&self, format: Format) -> String {
        match format {
            Format::Mermaid => self.mermaid(),
            Format::Dot => self.dot(),
        }
    }

    /// The diagram as JSON, for the admin page to draw: `{title, initial, states: [{name,
    /// kind}], edges: [{from, to, label}]}`, states by name; `kind` is `normal`, `completed`,
    /// `failed`, `compensated` or `parked`.
    pub fn to_json(&self) -> serde_json::Value {
        let name = |i: usize| self.states[i].0.clone();
        serde_json::json!({
            "title": self.title,
            "initial": self.initial.map(name),
            "states": self.states.iter().map(|(n, k)| serde_json::json!({
                "name": n,
                "kind": match k {
                    Kind::Normal => "normal",
                    Kind::Ends(o) => outcome_class(*o),
                    Kind::Parked => "parked",
                },
            })).collect::<Vec<_>>(),
            "edges": self.edges.iter().map(|(f, t, l)| serde_json::json!({
                "from": name(*f), "to": name(*t), "label": l,
            })).collect::<Vec<_>>(),
        })
    }

    fn find(&self, name: &str) -> Option<usize> {
        self.states.iter().position(|(n, _)| n == name)
    }

    fn state(&mut self, name: &str, kind: Kind) -> usize {
        match self.find(name) {
            Some(i) => i,
            None => {
                self.states.push((name.to_string(), kind));
                self.states.len() - 1
            }
        }
    }

    fn edge(&mut self, from: &str, to: &str, label: String) {
        let from = self.state(from, Kind::Normal);
        let to = self.state(to, Kind::Normal);
        self.edges.push((from, to, label));
    }

    fn mermaid(&self) -> String {
        let mut out = String::from("stateDiagram-v2\n");
        let _ = writeln!(out, "    %% {}", self.title);
        for (i, (name, _)) in self.states.iter().enumerate() {
            let _ = writeln!(out, "    state \"{}\" as s{i}", mermaid_text(name));
        }
        if let Some(i) = self.initial {
            let _ = writeln!(out, "    [*] --> s{i}");
        }
        for (from, to, label) in &self.edges {
            let _ = writeln!(out, "    s{from} --> s{to} : {}", mermaid_text(label));
        }
        for (i, (_, kind)) in self.states.iter().enumerate() {
            match kind {
                Kind::Ends(outcome) => {
                    let _ = writeln!(out, "    s{i} --> [*]");
                    let _ = writeln!(out, "    class s{i} {}", outcome_class(*outcome));
                }
                Kind::Parked => {
                    let _ = writeln!(out, "    class s{i} parked");
                }
                Kind::Normal => {}
            }
        }
        out.push_str("    classDef completed fill:#d4f4dd,stroke:#2f855a\n");
        out.push_str("    classDef failed fill:#fde2e1,stroke:#c53030\n");
        out.push_str("    classDef compensated fill:#fef3c7,stroke:#b7791f\n");
        out.push_str("    classDef parked fill:#e2e8f0,stroke:#4a5568,stroke-dasharray:4\n");
        out
    }

    fn dot(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "digraph {} {{", dot_text(&self.title));
        out.push_str("    rankdir=LR;\n    node [shape=box, style=rounded];\n");
        if let Some(i) = self.initial {
            out.push_str("    start [shape=point, width=0.15];\n");
            let _ = writeln!(out, "    start -> s{i};");
        }
        for (i, (name, kind)) in self.states.iter().enumerate() {
            let extra = match kind {
                Kind::Normal => String::new(),
                Kind::Ends(o) => format!(
                    ", peripheries=2, style=\"rounded,filled\", fillcolor={}",
                    dot_text(outcome_color(*o))
                ),
                Kind::Parked => ", style=\"rounded,dashed\"".to_string(),
            };
            let _ = writeln!(out, "    s{i} [label={}{extra}];", dot_text(name));
        }
        for (from, to, label) in &self.edges {
            let _ = writeln!(out, "    s{from} -> s{to} [label={}];", dot_text(label));
        }
        out.push_str("}\n");
        out
    }
}

/// The orchestration's states and edges, as `saga/orchestrate.rs` moves through them.
fn orchestration(d: &mut Diagram, o: &Orchestration) {
    let stage_name = |stage: &[usize]| {
        let names: Vec<&str> = stage.iter().map(|&i| o.steps[i].name.as_str()).collect();
        format!("step:{}", names.join("+"))
    };
    for stage in &o.stages {
        d.state(&stage_name(stage), Kind::Normal);
    }
    d.state("completed", Kind::Ends(Outcome::Completed));
    // Compensable steps in declaration order: the compensation chain runs it backwards.
    let compensable: Vec<usize> = (0..o.steps.len())
        .filter(|&i| o.steps[i].compensation.is_some())
        .collect();
    for &i in compensable.iter().rev() {
        d.state(&format!("compensating:{}", o.steps[i].name), Kind::Normal);
    }
    d.state("compensated", Kind::Ends(Outcome::Compensated));
    if !compensable.is_empty() {
        d.state("needs_operator", Kind::Parked);
    }
    d.initial = o.stages.first().and_then(|s| d.find(&stage_name(s)));
    // The compensation a failure before step index `before` starts with.
    let chain_from = |before: usize| {
        compensable
            .iter()
            .rev()
            .find(|&&i| i < before)
            .map_or("compensated".to_string(), |&i| {
                format!("compensating:{}", o.steps[i].name)
            })
    };
    for (k, stage) in o.stages.iter().enumerate() {
        let here = stage_name(stage);
        let next = o
            .stages
            .get(k + 1)
            .map_or("completed".to_string(), |s| stage_name(s));
        // Parallel steps: each must succeed (by any of its own success events).
        let success: Vec<String> = stage
            .iter()
            .map(|&i| o.steps[i].success.join(" | "))
            .collect();
        d.edge(&here, &next, success.join(" & "));
        let mut failure: Vec<String> = stage
            .iter()
            .flat_map(|&i| {
                let s = &o.steps[i];
                s.failure.iter().chain(&s.abort).cloned()
            })
            .collect();
        failure.dedup();
        let retried = stage.iter().any(|&i| {
            matches!(o.steps[i].action, Emit::Command { .. }) && o.steps[i].retry.is_some()
        });
        let tail = if retried {
            " (retries spent), or abort"
        } else {
            ""
        };
        // A failed stage compensates what completed before it; in a parallel stage a
        // sibling that succeeded is compensated too.
        let last = stage.iter().max().copied().unwrap_or(0);
        let before = if stage.len() > 1 { last + 1 } else { last };
        d.edge(
            &here,
            &chain_from(before),
            format!("{}{tail}", failure.join(" | ")),
        );
    }
    for &i in compensable.iter().rev() {
        let s = &o.steps[i];
        let Some(c) = &s.compensation else { continue };
        let here = format!("compensating:{}", s.name);
        d.edge(&here, &chain_from(i), c.success.join(" | "));
        d.edge(
            &here,
            "needs_operator",
            format!("{} (retries spent)", c.failure.join(" | ")),
        );
    }
}

/// `event [guard] / what it does`.
fn transition_label(event: &str, t: &Transition) -> String {
    let mut label = event.to_string();
    if let Some(w) = &t.when {
        let _ = write!(label, " [{}]", w.source());
    }
    let mut does: Vec<String> = t.emit.iter().map(emit_label).collect();
    for timer in &t.timers {
        does.push(match &timer.when {
            TimerWhen::Delay(ms) => format!("timer {} +{}", timer.name, duration(*ms)),
            TimerWhen::At(e) => format!("timer {} at {}", timer.name, e.source()),
        });
    }
    does.extend(t.cancel_timers.iter().map(|n| format!("cancel {n}")));
    if !does.is_empty() {
        let _ = write!(label, " / {}", does.join(", "));
    }
    label
}

fn emit_label(e: &Emit) -> String {
    match e {
        Emit::Effect { name, .. } => format!("effect {name}"),
        Emit::Command {
            aggregate_type,
            command,
            ..
        } => format!("command {aggregate_type}.{command}"),
        Emit::Event { event_type, .. } => format!("event {event_type}"),
    }
}

/// Milliseconds as people write them: `15m`, `2h30m`, `1500ms`.
fn duration(ms: u64) -> String {
    if ms == 0 || !ms.is_multiple_of(1000) {
        return format!("{ms}ms");
    }
    let mut s = ms / 1000;
    let mut out = String::new();
    for (unit, size) in [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)] {
        if s >= size {
            let _ = write!(out, "{}{unit}", s / size);
            s %= size;
        }
    }
    out
}

fn outcome_class(o: Outcome) -> &'static str {
    match o {
        Outcome::Completed => "completed",
        Outcome::Failed => "failed",
        Outcome::Compensated => "compensated",
    }
}

fn outcome_color(o: Outcome) -> &'static str {
    match o {
        Outcome::Completed => "#d4f4dd",
        Outcome::Failed => "#fde2e1",
        Outcome::Compensated => "#fef3c7",
    }
}

/// Text inside a Mermaid label or state description, as Mermaid's entity codes where the
/// character would end the text (`"`, `;`), start an entity (`#`) or read as markup when
/// drawn (`<`, `>`); line breaks and other control characters become spaces.
fn mermaid_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("#quot;"),
            '<' => out.push_str("#lt;"),
            '>' => out.push_str("#gt;"),
            ';' | '#' => {
                let _ = write!(out, "#{};", u32::from(c));
            }
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// A DOT quoted string.
fn dot_text(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            '\n' | '\r' => out.push_str("\\n"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(duration(900_000), "15m");
        assert_eq!(duration(9_000_000), "2h30m");
        assert_eq!(duration(1_500), "1500ms");
        assert_eq!(duration(86_400_000 + 1_000), "1d1s");
    }

    #[test]
    fn labels_cannot_break_out_of_either_format() {
        let evil = "a; b\" } -> x [label=y] # <b> %% : | (c)\n";
        let m = mermaid_text(evil);
        assert_eq!(
            m,
            "a#59; b#quot; } -#gt; x [label=y] #35; #lt;b#gt; %% : | (c) "
        );
        let d = dot_text(evil);
        assert!(d.starts_with('"') && d.ends_with('"'));
        assert!(!d[1..d.len() - 1].replace("\\\"", "").contains('"'), "{d}");
        assert!(!d.contains('\n'), "{d}");
    }
}
