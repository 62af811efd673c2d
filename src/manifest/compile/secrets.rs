//! References to effect secrets.
//!
//! Guarantee: every `saga.secrets.<name>` an effect's settings read names a secret that
//! effect declares under `settings.secrets`; a reference to any other name is a load error
//! located at the setting that holds it (its key's line and column), naming the setting's
//! path and the secrets declared. Without this check a misspelt secret would only surface
//! as a failed call at run time.
//!
//! Templates that do not compile are left to the provider's own settings check, which
//! reports them; a template that uses `saga.secrets` whole (not one name) cannot be checked
//! and is accepted.

use std::collections::BTreeSet;

use serde_json::Value as Json;

use super::diags::{Diags, at};
use crate::expr::{Expr, Needs, Template};
use crate::manifest::model::EffectDecl;

/// Settings that are CEL conditions rather than templates.
const CONDITIONS: [&str; 1] = ["success_when"];

/// Reports each undeclared secret an effect's settings read.
pub(super) fn check_references(d: &mut Diags<'_>, e: &EffectDecl) {
    let declared: BTreeSet<String> = e
        .settings
        .0
        .iter()
        .find(|(k, _)| k.value == "secrets")
        .and_then(|(_, v)| v.as_object())
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    for (key, value) in &e.settings.0 {
        if key.value == "secrets" {
            continue;
        }
        let mut found = Vec::new();
        if CONDITIONS.contains(&key.value.as_str()) {
            if let Some(src) = value.as_str()
                && let Ok(expr) = Expr::compile(src)
            {
                secrets_read(expr.needs(), &key.value, &mut found);
            }
        } else {
            walk(value, &key.value, &mut found);
        }
        for (path, name) in found {
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
                at(key),
                format!(
                    "effect `{}`: setting `{path}` reads `saga.secrets.{name}`, which the \
                     effect does not declare ({known}); declare it under `settings.secrets` \
                     as `{name}: {{ env: VAR }}` or `{name}: {{ file: path }}`",
                    e.name.value
                ),
            );
        }
    }
}

/// Collects `(setting path, secret name)` for every string template under `v`.
fn walk(v: &Json, path: &str, out: &mut Vec<(String, String)>) {
    match v {
        Json::String(s) => {
            if let Ok(t) = Template::compile_str(s) {
                let mut needs = Needs::default();
                t.add_needs(&mut needs);
                secrets_read(&needs, path, out);
            }
        }
        Json::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                walk(item, &format!("{path}[{i}]"), out);
            }
        }
        Json::Object(m) => {
            for (k, item) in m {
                walk(item, &format!("{path}.{k}"), out);
            }
        }
        _ => {}
    }
}

fn secrets_read(needs: &Needs, path: &str, out: &mut Vec<(String, String)>) {
    for name in needs.fields_read("saga", &["secrets"]).unwrap_or_default() {
        out.push((path.to_owned(), name));
    }
}
