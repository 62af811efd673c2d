//! Plain field paths: the expressions that only read one field (`state.order_id`,
//! `event.payload.amount_cents`), answered straight from the JSON without building CEL values.
//!
//! Most manifest expressions are such paths (correlation ids, state updates, payload fields),
//! and running them through the interpreter costs a CEL map per object on the way.
//!
//! Guarantee: a path gives exactly what the compiled program gives, or defers to it. It only
//! answers when every step finds an object holding the field; the value is then the JSON
//! under it, which is what the program's result converts back to (integers stay integers,
//! objects have sorted keys). A missing field, a non-object on the way or a `has()` test is
//! left to the program, so errors keep their wording.

use cel::common::ast::{Expr as Ast, IdedExpr};
use serde_json::Value as Json;

/// A chain of field selections from one of the three variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Path {
    root: Root,
    fields: Box<[String]>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Root {
    Event,
    State,
    Saga,
}

impl Path {
    /// The path an expression is, when it is nothing but field selections (no `has()`, no
    /// index, no call) from `event`, `state` or `saga` with at least one field.
    pub(super) fn of(ast: &IdedExpr) -> Option<Path> {
        let mut fields = Vec::new();
        let mut cur = ast;
        loop {
            match &cur.expr {
                Ast::Select(s) if !s.test => {
                    fields.push(s.field.clone());
                    cur = &s.operand;
                }
                Ast::Ident(name) => {
                    let root = match name.as_str() {
                        "event" => Root::Event,
                        "state" => Root::State,
                        "saga" => Root::Saga,
                        _ => return None,
                    };
                    if fields.is_empty() {
                        return None;
                    }
                    fields.reverse();
                    return Some(Path {
                        root,
                        fields: fields.into(),
                    });
                }
                _ => return None,
            }
        }
    }

    /// The value at this path, or `None` when the program must answer (see the module docs).
    /// `extra` are the string fields the `event` variable carries beside its envelope; they
    /// take precedence over envelope fields of the same name, as in the bound variable.
    pub(super) fn read(
        &self,
        event: &Json,
        extra: &[(&str, &str)],
        state: &Json,
        saga: &Json,
    ) -> Option<Json> {
        Some(match self.find(event, extra, state, saga)? {
            Found::Json(v) => v.clone(),
            Found::Str(s) => Json::String(s.to_owned()),
        })
    }

    /// Where the value at this path is, without copying it; `None` as for [`Path::read`].
    pub(super) fn find<'j>(
        &self,
        event: &'j Json,
        extra: &[(&str, &'j str)],
        state: &'j Json,
        saga: &'j Json,
    ) -> Option<Found<'j>> {
        let (first, rest) = self.fields.split_first()?;
        let start = match self.root {
            Root::Event => {
                if let Some((_, v)) = extra.iter().find(|(k, _)| k == first) {
                    // A string has no fields: selecting into it is the program's error.
                    return rest.is_empty().then_some(Found::Str(v));
                }
                event
            }
            Root::State => state,
            Root::Saga => saga,
        };
        let mut cur = start.as_object()?.get(first)?;
        for field in rest {
            cur = cur.as_object()?.get(field)?;
        }
        Some(Found::Json(cur))
    }
}

/// A value a path found: a part of a variable, or one of the event's extra string fields.
pub(super) enum Found<'j> {
    Json(&'j Json),
    Str(&'j str),
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use crate::expr::{Expr, Needs, Vars};

    #[test]
    fn paths_are_recognised_only_when_plain() {
        for (src, plain) in [
            ("state.order_id", true),
            ("event.payload.items", true),
            ("saga.name", true),
            ("event", false),
            ("has(state.x)", false),
            ("state['x']", false),
            ("state.x + 1", false),
            ("state.items.map(i, i.sku)", false),
        ] {
            assert_eq!(Expr::compile(src).unwrap().is_path(), plain, "{src}");
        }
    }

    #[test]
    fn a_path_gives_what_the_program_gives() {
        let event = json!({"event_type": "X", "name": "shadowed", "payload": {"n": 3, "u": 18446744073709551615u64,
            "f": 1.5, "whole": 2.0, "m": {"z": 1, "a": [1, {"k": null}]}, "s": "txt", "b": false}});
        let state = json!({"total": 10, "nested": {"deep": {"x": 1}}, "list": [1, 2]});
        let saga = json!({"name": "s", "version": 1});
        let extra = [("name", "Real"), ("subject", "aggregate.A.a-1")];
        for src in [
            "event.payload.n",
            "event.payload.u",
            "event.payload.f",
            "event.payload.whole",
            "event.payload.m",
            "event.payload.s",
            "event.payload.b",
            "event.payload.missing",
            "event.payload.s.x",
            "event.name",
            "event.name.x",
            "event.subject",
            "event.event_type",
            "state.nested.deep",
            "state.nested.deep.x",
            "state.list.x",
            "state.total.x",
            "saga.name",
            "saga.nope",
        ] {
            let e = Expr::compile(src).unwrap();
            assert!(e.is_path(), "{src}");
            let all = Needs::everything();
            let full = Vars::pruned(&event, &extra, &state, &saga, &all);
            let slow = e.eval_program(&full).map_err(|x| x.to_string());
            let pruned = Vars::pruned(&event, &extra, &state, &saga, e.needs());
            let fast = e.eval(&pruned).map_err(|x| x.to_string());
            assert_eq!(
                slow.as_ref().map(|j| j.to_string()),
                fast.as_ref().map(|j| j.to_string()),
                "{src}"
            );
        }
    }
}
