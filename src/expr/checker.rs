//! The determinism checker: the static checks every expression passes before it may run.
//!
//! It walks the syntax tree once, at compile time, and refuses what could make the same
//! inputs give different outputs or fail late: names other than the three variables (and
//! loop variables), constant sub-expressions that already fail, two-variable comprehensions,
//! and order-producing comprehensions (`map`, `filter`) over a map. When the range of such a
//! comprehension cannot be known at compile time it is returned, so that evaluation checks
//! it is a list before running ([`ExprError::MapIteration`] otherwise).

use std::sync::Arc;

use cel::common::ast::{EntryExpr, Expr as Ast, IdedExpr};
use cel::{Context, Env, Value};

use super::error::ExprError;

/// Variables an expression may name at its top level.
pub const ROOTS: [&str; 3] = ["event", "state", "saga"];

/// Type names and constants CEL resolves as identifiers.
const BUILTIN_IDENTS: [&str; 12] = [
    "int",
    "uint",
    "double",
    "string",
    "bool",
    "bytes",
    "list",
    "map",
    "null_type",
    "type",
    "dyn",
    "optional_type",
];

/// Runs the static checks over a compiled expression. On success, returns the ranges of
/// order-producing comprehensions that evaluation must find to be lists; otherwise the first
/// problem found. Constant sub-expressions are evaluated in `env` to find type errors early.
pub(super) fn check(ast: &IdedExpr, env: &Arc<Env>) -> Result<Vec<IdedExpr>, ExprError> {
    let mut checker = Checker {
        env,
        bound: Vec::new(),
        errors: Vec::new(),
        ordered_ranges: Vec::new(),
    };
    checker.walk(ast);
    match checker.errors.into_iter().next() {
        Some(err) => Err(err),
        None => Ok(checker.ordered_ranges),
    }
}

/// The walk's state: the loop variables in scope, what was found, what evaluation checks.
struct Checker<'e> {
    env: &'e Arc<Env>,
    bound: Vec<String>,
    errors: Vec<ExprError>,
    ordered_ranges: Vec<IdedExpr>,
}

impl Checker<'_> {
    fn walk(&mut self, e: &IdedExpr) {
        match &e.expr {
            Ast::Ident(name) => {
                if !ROOTS.contains(&name.as_str())
                    && !BUILTIN_IDENTS.contains(&name.as_str())
                    && !self.bound.iter().any(|b| b == name)
                {
                    self.errors.push(ExprError::UnknownIdentifier(name.clone()));
                }
            }
            Ast::Call(call) => {
                if let Some(t) = &call.target {
                    self.walk(t);
                }
                for a in &call.args {
                    self.walk(a);
                }
                if self.bound.is_empty() && !references_any_ident(e) {
                    // A constant sub-expression: evaluating it now finds type errors early.
                    if let Err(err) = Value::resolve(e, &Context::with_env(self.env.clone())) {
                        self.errors.push(ExprError::Type(err.to_string()));
                    }
                }
            }
            Ast::Comprehension(c) => {
                self.walk(&c.iter_range);
                if c.iter_var2.is_some() {
                    self.errors.push(ExprError::MapIteration(
                        "two-variable comprehension".to_string(),
                    ));
                }
                let range_is_map = match &c.iter_range.expr {
                    Ast::Map(_) => true,
                    Ast::Ident(n) => ROOTS.contains(&n.as_str()),
                    Ast::Select(s) => {
                        matches!(&s.operand.expr, Ast::Ident(n) if n == "event")
                            && matches!(s.field.as_str(), "payload" | "metadata")
                    }
                    _ => false,
                };
                if range_is_map {
                    self.errors.push(ExprError::MapIteration(
                        "the range is a map literal or a known map".to_string(),
                    ));
                }
                // `map`/`filter` accumulate into a list: their result depends on order.
                if matches!(c.accu_init.expr, Ast::List(_)) {
                    if self.depends_on_bound(&c.iter_range) {
                        self.errors.push(ExprError::MapIteration(
                            "map/filter over a value derived from a loop variable".to_string(),
                        ));
                    } else {
                        self.ordered_ranges.push(c.iter_range.clone());
                    }
                }
                self.walk(&c.accu_init);
                self.bound.push(c.iter_var.clone());
                if let Some(v2) = &c.iter_var2 {
                    self.bound.push(v2.clone());
                }
                self.bound.push(c.accu_var.clone());
                self.walk(&c.loop_cond);
                self.walk(&c.loop_step);
                self.walk(&c.result);
                self.bound
                    .truncate(self.bound.len() - 2 - usize::from(c.iter_var2.is_some()));
            }
            Ast::List(l) => l.elements.iter().for_each(|x| self.walk(x)),
            Ast::Map(m) => {
                for entry in &m.entries {
                    if let EntryExpr::MapEntry(me) = &entry.expr {
                        self.walk(&me.key);
                        self.walk(&me.value);
                    }
                }
            }
            Ast::Struct(s) => {
                for entry in &s.entries {
                    if let EntryExpr::StructField(f) = &entry.expr {
                        self.walk(&f.value);
                    }
                }
            }
            Ast::Select(s) => self.walk(&s.operand),
            Ast::Literal(_) | Ast::Unspecified => {}
        }
    }

    fn depends_on_bound(&self, e: &IdedExpr) -> bool {
        let mut names = Vec::new();
        idents(e, &mut names);
        names.iter().any(|n| self.bound.iter().any(|b| b == n))
    }
}

fn references_any_ident(e: &IdedExpr) -> bool {
    let mut names = Vec::new();
    idents(e, &mut names);
    !names.is_empty()
}

fn idents(e: &IdedExpr, out: &mut Vec<String>) {
    match &e.expr {
        Ast::Ident(n) => out.push(n.clone()),
        Ast::Call(c) => {
            if let Some(t) = &c.target {
                idents(t, out);
            }
            c.args.iter().for_each(|a| idents(a, out));
        }
        Ast::Comprehension(c) => {
            // Treat a comprehension as variable-dependent: its loop variables are idents.
            out.push(c.iter_var.clone());
            idents(&c.iter_range, out);
        }
        Ast::List(l) => l.elements.iter().for_each(|x| idents(x, out)),
        Ast::Map(m) => {
            for entry in &m.entries {
                if let EntryExpr::MapEntry(me) = &entry.expr {
                    idents(&me.key, out);
                    idents(&me.value, out);
                }
            }
        }
        Ast::Struct(s) => {
            for entry in &s.entries {
                if let EntryExpr::StructField(f) = &entry.expr {
                    idents(&f.value, out);
                }
            }
        }
        Ast::Select(s) => idents(&s.operand, out),
        Ast::Literal(_) | Ast::Unspecified => {}
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::expr::{Expr, Vars};

    fn eval(src: &str, state: serde_json::Value) -> Result<serde_json::Value, ExprError> {
        let (event, saga) = (json!({}), json!({"name": "s"}));
        let vars = Vars::new(&event, &state, &saga);
        Expr::compile(src)?.eval(&vars)
    }

    #[test]
    fn static_checks() {
        assert!(matches!(
            Expr::compile("event.a +"),
            Err(ExprError::Syntax { .. })
        ));
        assert!(matches!(
            Expr::compile("foo.bar"),
            Err(ExprError::UnknownIdentifier(_))
        ));
        assert!(matches!(Expr::compile("1 + 'a'"), Err(ExprError::Type(_))));
        assert!(matches!(
            Expr::compile("{'a': 1}.map(k, k)"),
            Err(ExprError::MapIteration(_))
        ));
        assert!(matches!(
            Expr::compile("state.map(k, k)"),
            Err(ExprError::MapIteration(_))
        ));
        assert!(Expr::compile("event.payload.items.all(i, i.qty > 0)").is_ok());
        assert!(Expr::compile("event.payload.items.map(i, i.qty)").is_ok());
    }

    #[test]
    fn runtime_map_iteration_is_refused() {
        let err = eval("state.m.map(k, k)", json!({"m": {"a": 1}})).unwrap_err();
        assert!(matches!(err, ExprError::MapIteration(_)));
        let ok = eval("state.m.map(k, k * 2)", json!({"m": [1, 2]})).unwrap();
        assert_eq!(ok, json!([2, 4]));
    }
}
