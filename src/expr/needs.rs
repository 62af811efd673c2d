//! Needs and pruning: which parts of `event`, `state` and `saga` an expression can read,
//! and binding only those parts for an evaluation.
//!
//! Guarantee: an expression evaluated over variables pruned to (a superset of) its needs gives
//! exactly the result it gives over the full variables, because what is left out is what it
//! has no way to reach. Pruning only saves converting the whole envelope and state to CEL for
//! every evaluation.

use std::collections::HashMap;

use cel::common::ast::{EntryExpr, Expr as Ast, IdedExpr};
use cel::common::types::{CelMap, CelMapKey, CelString};
use cel::common::value::Val;
use serde_json::Value as Json;

use super::convert::json_to_val;

/// Which parts of `event`, `state` and `saga` some expressions can read.
///
/// Computed from the syntax tree at compile time: every maximal field-selection chain that
/// starts at a variable (`event.payload.amount`, `has(state.x)`) marks that path as needed
/// with everything under it; a variable used otherwise is needed whole. Binding only these
/// parts cannot change a result — an expression has no way to reach the rest — and saves
/// converting the whole envelope and state for every evaluation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Needs {
    event: Need,
    state: Need,
    saga: Need,
}

/// A tree of needed fields.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
enum Need {
    /// Nothing under this node is read.
    #[default]
    Nothing,
    /// Only these fields are read.
    Fields(std::collections::BTreeMap<String, Need>),
    /// Everything is read.
    Whole,
}

impl Need {
    fn mark(&mut self, path: &[String]) {
        match (path.split_first(), &mut *self) {
            (_, Need::Whole) => {}
            (None, _) => *self = Need::Whole,
            (Some((first, rest)), Need::Fields(f)) => {
                f.entry(first.clone()).or_default().mark(rest)
            }
            (Some((first, rest)), Need::Nothing) => {
                let mut child = Need::Nothing;
                child.mark(rest);
                *self = Need::Fields([(first.clone(), child)].into_iter().collect());
            }
        }
    }

    fn merge(&mut self, other: &Need) {
        match (&mut *self, other) {
            (Need::Whole, _) | (_, Need::Nothing) => {}
            (_, Need::Whole) => *self = Need::Whole,
            (Need::Nothing, o) => *self = o.clone(),
            (Need::Fields(a), Need::Fields(b)) => {
                for (k, v) in b {
                    a.entry(k.clone()).or_default().merge(v);
                }
            }
        }
    }

    fn wants(&self, field: &str) -> bool {
        match self {
            Need::Whole => true,
            Need::Fields(f) => f.contains_key(field),
            Need::Nothing => false,
        }
    }
}

impl Needs {
    /// Everything of every variable.
    pub fn everything() -> Self {
        Self {
            event: Need::Whole,
            state: Need::Whole,
            saga: Need::Whole,
        }
    }

    /// Whether any expression behind these needs reads the `saga` variable at all.
    pub fn reads_saga(&self) -> bool {
        self.saga != Need::Nothing
    }

    /// Whether these needs read nothing of `event` and `state`, and of `saga` at most its
    /// `secrets` (what the operator gives, never what an input carries).
    pub fn reads_only_secrets(&self) -> bool {
        self.event == Need::Nothing
            && self.state == Need::Nothing
            && match &self.saga {
                Need::Nothing => true,
                Need::Fields(f) => f.keys().all(|k| k == "secrets"),
                Need::Whole => false,
            }
    }

    /// Adds what `other` needs.
    pub fn merge(&mut self, other: &Needs) {
        self.event.merge(&other.event);
        self.state.merge(&other.state);
        self.saga.merge(&other.saga);
    }

    /// What one expression can read, from its syntax tree.
    pub(super) fn of(ast: &IdedExpr) -> Self {
        let mut needs = Needs::default();
        collect_needs(ast, &mut Vec::new(), &mut needs);
        needs
    }

    /// The CEL values of `event`, `state` and `saga`, pruned to these needs, with extra
    /// string fields added to the `event` object (when it is one). Nothing is copied.
    pub(super) fn bind<'v>(
        &self,
        event: &'v Json,
        extra: &[(&'v str, &'v str)],
        state: &'v Json,
        saga: &'v Json,
    ) -> [Box<dyn Val + 'v>; 3] {
        let event_val: Box<dyn Val + 'v> = match (event, &self.event) {
            (Json::Object(map), need) if !extra.is_empty() => {
                let mut m = object_needed(map, need);
                for (k, v) in extra {
                    if need.wants(k) {
                        m.insert(CelMapKey::from(*k), Box::new(CelString::from(*v)));
                    }
                }
                Box::new(CelMap::from(m))
            }
            (other, need) => json_to_val_needed(other, need),
        };
        [
            event_val,
            json_to_val_needed(state, &self.state),
            json_to_val_needed(saga, &self.saga),
        ]
    }

    /// The fields read directly under `root.path` (for `saga` and `["secrets"]`: the names
    /// of the secrets read), or `None` when the expression may read any of them (it uses
    /// the object, or one of its parents, whole).
    pub fn fields_read(&self, root: &str, path: &[&str]) -> Option<Vec<String>> {
        let mut need = match root {
            "event" => &self.event,
            "state" => &self.state,
            "saga" => &self.saga,
            _ => return Some(Vec::new()),
        };
        for field in path {
            need = match need {
                Need::Whole => return None,
                Need::Nothing => return Some(Vec::new()),
                Need::Fields(f) => match f.get(*field) {
                    Some(n) => n,
                    None => return Some(Vec::new()),
                },
            };
        }
        match need {
            Need::Whole => None,
            Need::Nothing => Some(Vec::new()),
            Need::Fields(f) => Some(f.keys().cloned().collect()),
        }
    }

    fn mark(&mut self, root: &str, path: &[String]) {
        match root {
            "event" => self.event.mark(path),
            "state" => self.state.mark(path),
            "saga" => self.saga.mark(path),
            _ => {}
        }
    }
}

fn object_needed<'v>(
    map: &'v serde_json::Map<String, Json>,
    need: &Need,
) -> HashMap<CelMapKey<'v>, Box<dyn Val + 'v>> {
    match need {
        Need::Whole => map
            .iter()
            .map(|(k, v)| (CelMapKey::from(k.as_str()), json_to_val(v)))
            .collect(),
        Need::Fields(fields) => fields
            .iter()
            .filter_map(|(k, n)| {
                map.get_key_value(k.as_str())
                    .map(|(k, v)| (CelMapKey::from(k.as_str()), json_to_val_needed(v, n)))
            })
            .collect(),
        Need::Nothing => HashMap::new(),
    }
}

fn json_to_val_needed<'v>(j: &'v Json, need: &Need) -> Box<dyn Val + 'v> {
    match (j, need) {
        (Json::Object(map), Need::Fields(_) | Need::Nothing) => {
            Box::new(CelMap::from(object_needed(map, need)))
        }
        // Selecting into a non-object fails the same way whatever is bound.
        _ => json_to_val(j),
    }
}

/// The variable path a field-selection chain reads: `event.payload.x` → (`event`, [payload, x]).
fn select_chain(e: &IdedExpr) -> Option<(&str, Vec<String>)> {
    let mut fields = Vec::new();
    let mut cur = e;
    loop {
        match &cur.expr {
            Ast::Select(s) => {
                fields.push(s.field.clone());
                cur = &s.operand;
            }
            Ast::Ident(n) => {
                fields.reverse();
                return Some((n.as_str(), fields));
            }
            _ => return None,
        }
    }
}

fn collect_needs(e: &IdedExpr, bound: &mut Vec<String>, out: &mut Needs) {
    if let Some((root, path)) = select_chain(e) {
        if !bound.iter().any(|b| b == root) {
            out.mark(root, &path);
        }
        return;
    }
    match &e.expr {
        Ast::Select(s) => collect_needs(&s.operand, bound, out),
        Ast::Call(c) => {
            if let Some(t) = &c.target {
                collect_needs(t, bound, out);
            }
            c.args.iter().for_each(|a| collect_needs(a, bound, out));
        }
        Ast::Comprehension(c) => {
            collect_needs(&c.iter_range, bound, out);
            collect_needs(&c.accu_init, bound, out);
            let n = bound.len();
            bound.push(c.iter_var.clone());
            if let Some(v2) = &c.iter_var2 {
                bound.push(v2.clone());
            }
            bound.push(c.accu_var.clone());
            collect_needs(&c.loop_cond, bound, out);
            collect_needs(&c.loop_step, bound, out);
            collect_needs(&c.result, bound, out);
            bound.truncate(n);
        }
        Ast::List(l) => l.elements.iter().for_each(|x| collect_needs(x, bound, out)),
        Ast::Map(m) => {
            for entry in &m.entries {
                if let EntryExpr::MapEntry(me) = &entry.expr {
                    collect_needs(&me.key, bound, out);
                    collect_needs(&me.value, bound, out);
                }
            }
        }
        Ast::Struct(st) => {
            for entry in &st.entries {
                if let EntryExpr::StructField(f) = &entry.expr {
                    collect_needs(&f.value, bound, out);
                }
            }
        }
        Ast::Ident(_) | Ast::Literal(_) | Ast::Unspecified => {}
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::expr::{Expr, Vars};

    #[test]
    fn fields_read_names_what_is_selected_and_admits_a_whole_use() {
        let e = Expr::compile("saga.secrets.a + saga.secrets['b'] + saga.secrets.c.d").unwrap();
        // `['b']` is an index, not a selection: the chain stops at `secrets`, read whole.
        assert_eq!(e.needs().fields_read("saga", &["secrets"]), None);
        let e = Expr::compile("saga.secrets.a + saga.secrets.c.d + event.payload.x").unwrap();
        assert_eq!(
            e.needs().fields_read("saga", &["secrets"]),
            Some(vec!["a".to_owned(), "c".to_owned()])
        );
        assert_eq!(e.needs().fields_read("state", &[]), Some(vec![]));
        assert_eq!(e.needs().fields_read("event", &["payload", "x", "y"]), None);
        assert_eq!(e.needs().fields_read("nope", &[]), Some(vec![]));
    }

    #[test]
    fn pruned_variables_give_the_same_results() {
        let event = json!({"event_type": "X", "aggregate_id": "a-1", "payload": {"n": 3, "m": {"k": [1, 2]},
            "items": [{"sku": "s", "qty": 2}], "s": "txt"}, "metadata": {"correlation_id": "c"}});
        let state = json!({"total": 10, "items": [{"sku": "s"}], "nested": {"deep": {"x": 1}}});
        let saga =
            json!({"name": "s", "tenant": "t", "version": 1, "state": "a", "correlation_id": "c"});
        let exprs = [
            "event.payload.n + state.total",
            "has(event.payload.m) && has(event.payload.zz) == false",
            "event.payload['m'].k[1]",
            "size(event.payload) + size(state)",
            "event.payload.items.map(i, i.qty * 2)",
            "state.items.exists(i, i.sku == event.payload.s)",
            "state.nested.deep",
            "state.nested.deep.missing",
            "event.payload.s.x",
            "saga.name + '/' + saga.correlation_id + event.name",
            "event",
            "[state, saga.version]",
            "has(state.nested.deep.x) ? state.nested.deep.x : 0",
            "event.metadata.correlation_id in ['c', 'd']",
        ];
        let all = Needs::everything();
        for src in exprs {
            let e = Expr::compile(src).unwrap();
            let extra = [("name", "X"), ("subject", "aggregate.A.a-1")];
            let with_extra = Vars::pruned(&event, &extra, &state, &saga, &all);
            let pruned = Vars::pruned(&event, &extra, &state, &saga, e.needs());
            // The interpreter over everything, against whatever `eval` does over the pruned.
            let want = e.eval_program(&with_extra).map_err(|e| format!("{e}"));
            let got = e.eval(&pruned).map_err(|e| format!("{e}"));
            assert_eq!(want, got, "{src}");
        }
        // A field-only expression does not need the whole envelope.
        let e = Expr::compile("event.payload.n > 1").unwrap();
        assert_ne!(e.needs(), &Needs::everything());
    }
}
