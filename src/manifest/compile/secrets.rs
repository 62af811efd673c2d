//! References to effect secrets.
//!
//! Guarantee: every `saga.secrets.<name>` an effect's settings read names a secret that
//! effect declares under `settings.secrets`; a reference to any other name is a load error
//! located at the string that holds it (the line and column of its key, or of the list
//! item), naming the setting's path and the secrets declared. Without this check a misspelt secret would only surface
//! as a failed call at run time.
//!
//! Templates that do not compile are left to the provider's own settings check, which
//! reports them; a template that uses `saga.secrets` whole (not one name) cannot be checked
//! and is accepted.

use std::collections::BTreeSet;

use serde_saphyr::Location;

use super::diags::{Diags, at};
use crate::expr::{Expr, Needs, Template};
use crate::manifest::model::{EffectDecl, Sp, TemplateNode};

/// Settings that are CEL conditions rather than templates.
const CONDITIONS: [&str; 1] = ["success_when"];

/// One read of a secret: the setting's path, the secret's name, where the setting is.
type Read = (String, String, Location);

/// Reports each undeclared secret an effect's settings read.
pub(super) fn check_references(d: &mut Diags<'_>, e: &EffectDecl) {
    let declared: BTreeSet<String> = e
        .settings
        .0
        .iter()
        .find(|(k, _)| k.value == "secrets")
        .map(|(_, v)| match &v.value {
            TemplateNode::Map(fields) => fields.iter().map(|(k, _)| k.value.clone()).collect(),
            _ => BTreeSet::new(),
        })
        .unwrap_or_default();
    let mut found: Vec<Read> = Vec::new();
    for (key, value) in &e.settings.0 {
        if key.value == "secrets" {
            continue;
        }
        if CONDITIONS.contains(&key.value.as_str()) {
            if let TemplateNode::Str(src) = &value.value
                && let Ok(expr) = Expr::compile(src)
            {
                secrets_read(expr.needs(), &key.value, at(key), &mut found);
            }
        } else {
            walk(value, &key.value, at(key), &mut found);
        }
    }
    for (path, name, loc) in found {
        if declared.contains(&name) {
            continue;
        }
        let known = if declared.is_empty() {
            "none is declared".to_owned()
        } else {
            let names: Vec<&str> = declared.iter().map(String::as_str).collect();
            format!("declared: {}", names.join(", "))
        };
        d.error(
            loc,
            format!(
                "effect `{}`: setting `{path}` reads `saga.secrets.{name}`, which the effect \
                 does not declare ({known}); declare it under `settings.secrets` as \
                 `{name}: {{ env: VAR }}` or `{name}: {{ file: path }}`",
                e.name.value
            ),
        );
    }
}

/// Collects every secret read by a string template under `node` (at `path`, written at
/// `loc`: the key of a map entry, or the list item itself).
fn walk(node: &Sp<TemplateNode>, path: &str, loc: Location, out: &mut Vec<Read>) {
    match &node.value {
        TemplateNode::Str(s) => {
            if let Ok(t) = Template::compile_str(s) {
                let mut needs = Needs::default();
                t.add_needs(&mut needs);
                secrets_read(&needs, path, loc, out);
            }
        }
        TemplateNode::List(items) => {
            for (i, item) in items.iter().enumerate() {
                walk(item, &format!("{path}.{i}"), at(item), out);
            }
        }
        TemplateNode::Map(fields) => {
            for (k, item) in fields {
                walk(item, &format!("{path}.{}", k.value), at(k), out);
            }
        }
        TemplateNode::Scalar(_) => {}
    }
}

fn secrets_read(needs: &Needs, path: &str, loc: Location, out: &mut Vec<Read>) {
    for name in needs.fields_read("saga", &["secrets"]).unwrap_or_default() {
        out.push((path.to_owned(), name, loc));
    }
}
