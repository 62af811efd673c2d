//! What an expression's value can be, as far as its syntax alone tells: enough for the
//! validator to refuse a guard that can never be a boolean (`when: state.total + 1`) and to
//! warn about one whose type only the data decides (`when: state.ending`).
//!
//! Guarantee: [`Yields::Bool`] and [`Yields::NotBool`] are certain — an operator, macro or
//! literal at the top decides them (a conditional decides when both branches agree); anything
//! else is [`Yields::Unknown`], never a guess.

use cel::common::ast::{Expr as Ast, IdedExpr, LiteralValue as CelVal, operators as op};

/// What an expression gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Yields {
    /// Always a boolean (or an evaluation error).
    Bool,
    /// Never a boolean: what it gives instead, in words.
    NotBool(&'static str),
    /// Decided by the data: a field, a variable, a function whose result type varies.
    Unknown,
}

/// Operators and functions whose result is a boolean.
const BOOLEAN: [&str; 16] = [
    op::LOGICAL_AND,
    op::LOGICAL_OR,
    op::LOGICAL_NOT,
    op::EQUALS,
    op::NOT_EQUALS,
    op::GREATER,
    op::GREATER_EQUALS,
    op::LESS,
    op::LESS_EQUALS,
    op::IN,
    op::NOT_STRICTLY_FALSE,
    "contains",
    "startsWith",
    "endsWith",
    "matches",
    "bool",
];

/// Of `e`, from its top node.
pub(super) fn of(e: &IdedExpr) -> Yields {
    match &e.expr {
        Ast::Literal(CelVal::Boolean(_)) => Yields::Bool,
        Ast::Literal(CelVal::String(_)) => Yields::NotBool("a string"),
        Ast::Literal(CelVal::Null) => Yields::NotBool("null"),
        Ast::Literal(CelVal::Bytes(_)) => Yields::NotBool("bytes"),
        Ast::Literal(_) => Yields::NotBool("a number"),
        Ast::List(_) => Yields::NotBool("a list"),
        Ast::Map(_) | Ast::Struct(_) => Yields::NotBool("a map"),
        // `has(x.y)` is a select marked as a test.
        Ast::Select(s) if s.test => Yields::Bool,
        Ast::Select(_) | Ast::Ident(_) | Ast::Unspecified => Yields::Unknown,
        Ast::Call(c) if BOOLEAN.contains(&c.func_name.as_str()) => Yields::Bool,
        Ast::Call(c) => match c.func_name.as_str() {
            op::ADD | op::SUBSTRACT | op::MULTIPLY | op::DIVIDE | op::MODULO | op::NEGATE => {
                Yields::NotBool("arithmetic (a number, or joined text or lists)")
            }
            "size" | "int" | "uint" | "double" => Yields::NotBool("a number"),
            "string" => Yields::NotBool("a string"),
            op::CONDITIONAL => match (c.args.get(1).map(of), c.args.get(2).map(of)) {
                (Some(Yields::Bool), Some(Yields::Bool)) => Yields::Bool,
                (Some(Yields::NotBool(w)), Some(Yields::NotBool(_))) => Yields::NotBool(w),
                _ => Yields::Unknown,
            },
            _ => Yields::Unknown,
        },
        // Macros: `all`/`exists` fold into a boolean accumulator, `map`/`filter` into a
        // list; `exists_one` counts and compares, which its result expression shows.
        Ast::Comprehension(c) => match &c.accu_init.expr {
            Ast::Literal(CelVal::Boolean(_)) => Yields::Bool,
            Ast::List(_) => Yields::NotBool("a list"),
            _ => of(&c.result),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yields(src: &str) -> Yields {
        crate::expr::Expr::compile(src).expect(src).yields()
    }

    #[test]
    fn operators_and_literals_decide_fields_do_not() {
        for src in [
            "true",
            "state.n > 1 && has(event.payload.x)",
            "!state.done",
            "'a' in state.tags",
            "state.name.startsWith('x')",
            "event.payload.items.all(i, i.qty > 0)",
            "event.payload.items.exists(i, i.qty > 0)",
            "event.payload.items.exists_one(i, i.qty > 0)",
            "state.a ? true : state.b == 1",
        ] {
            assert_eq!(yields(src), Yields::Bool, "{src}");
        }
        for src in [
            "'yes'",
            "1",
            "state.total + 1",
            "size(state.items)",
            "[1, 2]",
            "{'a': 1}",
            "event.payload.items.map(i, i.qty)",
            "string(state.n)",
            "null",
        ] {
            assert!(matches!(yields(src), Yields::NotBool(_)), "{src}");
        }
        for src in [
            "state.ending",
            "event.payload.approved",
            "state.a ? state.b : true",
        ] {
            assert_eq!(yields(src), Yields::Unknown, "{src}");
        }
    }
}
