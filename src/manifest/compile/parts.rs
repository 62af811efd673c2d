//! The parts every saga style is built from: expressions, templates and emit calls (effect,
//! command, event), each compiled with its problems reported at the place they were written.
//!
//! Guarantee: a part either compiles or leaves an error diagnostic behind. Each function
//! returns `None` only after recording why, so a saga that is missing a part is never built
//! silently; an expression's syntax error points into the expression when the YAML scalar
//! allows it.

use std::collections::BTreeSet;

use super::diags::{Diags, at};
use crate::expr::{Expr, ExprError, Template};
use crate::manifest::catalog::Emit;
use crate::manifest::model::{CommandCall, EffectCall, EventCall, Sp, TemplateNode};
use crate::manifest::{Diagnostic, Severity};

/// Compiles one saga version, reporting into the diagnostics of its file. Its methods are
/// spread by concern: the parts every style shares here, the saga itself in `mod.rs`, the
/// styles in `machine.rs` and `orchestration.rs`.
pub(super) struct SagaCompiler<'a, 'b> {
    pub(super) d: &'a mut Diags<'b>,
    /// Names of the declared effects (from every file).
    pub(super) effects: &'a BTreeSet<&'a str>,
}

impl SagaCompiler<'_, '_> {
    pub(super) fn expr(&mut self, src: &Sp<String>, what: &str) -> Option<Expr> {
        match Expr::compile(&src.value) {
            Ok(e) => Some(e),
            Err(err) => {
                let loc = at(src);
                let mut column = loc.column();
                // Point into the expression when the YAML scalar is on one line: plain
                // (its span is the text itself) or quoted (one more character before it).
                if let ExprError::Syntax {
                    line: 1, column: c, ..
                } = &err
                {
                    let text_len = src.value.chars().count() as u64;
                    let span_len = loc.span().len();
                    if span_len == text_len {
                        column += u64::from(*c) - 1;
                    } else if span_len == text_len + 2 {
                        column += u64::from(*c);
                    }
                }
                let message = format!("{what}: {err}");
                self.d.out.push(Diagnostic {
                    file: self.d.file.to_path_buf(),
                    line: loc.line(),
                    column,
                    severity: Severity::Error,
                    message,
                });
                None
            }
        }
    }

    pub(super) fn template(&mut self, node: &Sp<TemplateNode>, what: &str) -> Option<Template> {
        let mut ok = true;
        let t = self.template_inner(node, what, &mut ok);
        ok.then_some(t)
    }

    fn template_inner(&mut self, node: &Sp<TemplateNode>, what: &str, ok: &mut bool) -> Template {
        match &node.value {
            TemplateNode::Scalar(v) => Template::Literal(v.clone()),
            TemplateNode::Str(s) => match Template::compile_str(s) {
                Ok(t) => t,
                Err(err) => {
                    self.d.error(at(node), format!("{what}: {err}"));
                    *ok = false;
                    Template::Literal(serde_json::Value::Null)
                }
            },
            TemplateNode::List(items) => {
                let items: Vec<Template> = items
                    .iter()
                    .map(|i| self.template_inner(i, what, ok))
                    .collect();
                if items.iter().all(Template::is_literal) {
                    Template::Literal(serde_json::Value::Array(
                        items.into_iter().filter_map(literal).collect(),
                    ))
                } else {
                    Template::List(items)
                }
            }
            TemplateNode::Map(fields) => {
                let fields: Vec<(String, Template)> = fields
                    .iter()
                    .map(|(k, v)| (k.value.clone(), self.template_inner(v, what, ok)))
                    .collect();
                if fields.iter().all(|(_, t)| t.is_literal()) {
                    Template::Literal(serde_json::Value::Object(
                        fields
                            .into_iter()
                            .filter_map(|(k, t)| literal(t).map(|v| (k, v)))
                            .collect(),
                    ))
                } else {
                    Template::object(fields)
                }
            }
        }
    }

    pub(super) fn opt_template(
        &mut self,
        node: &Option<Sp<TemplateNode>>,
        what: &str,
    ) -> Option<Template> {
        match node {
            Some(n) => self.template(n, what),
            None => Some(Template::Literal(serde_json::Value::Null)),
        }
    }

    pub(super) fn effect_call(&mut self, e: &EffectCall) -> Option<Emit> {
        if !self.effects.contains(e.name.value.as_str()) {
            self.d
                .error(at(&e.name), format!("unknown effect `{}`", e.name.value));
        }
        let payload = self.opt_template(&e.payload, "effect payload")?;
        Some(Emit::Effect {
            name: e.name.value.clone(),
            payload,
            retry: e.retry,
        })
    }

    pub(super) fn command_call(&mut self, c: &CommandCall) -> Option<Emit> {
        for (v, what) in [
            (&c.aggregate_type, "aggregate type"),
            (&c.command, "command"),
        ] {
            if v.value.is_empty() || v.value.contains(['.', '*', '>', ' ']) {
                self.d.error(
                    at(v),
                    format!("{what} `{}` is not a valid subject token", v.value),
                );
            }
        }
        let id = self.template(&c.aggregate_id, "aggregate id");
        let payload = self.opt_template(&c.payload, "command payload");
        Some(Emit::Command {
            aggregate_type: c.aggregate_type.value.clone(),
            command: c.command.value.clone(),
            aggregate_id: id?,
            payload: payload?,
        })
    }

    pub(super) fn event_call(&mut self, e: &EventCall) -> Option<Emit> {
        let payload = self.opt_template(&e.payload, "event payload")?;
        Some(Emit::Event {
            event_type: e.event_type.value.clone(),
            payload,
        })
    }
}

fn literal(t: Template) -> Option<serde_json::Value> {
    match t {
        Template::Literal(v) => Some(v),
        _ => None,
    }
}
