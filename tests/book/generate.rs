//! The book's generated pages (`docs/book/src/generated/*.md`), computed from the program:
//! the manifest keys from the JSON Schema, the configuration keys from `Config::default()`
//! and `config/default.toml`, the metrics from `src/telemetry/mod.rs`, and the table of
//! retry waits from the backoff function itself.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde_json::Value as Json;

use super::markdown::root;

/// A table cell: one line, pipes escaped, and `<`/`>` outside code spans written as
/// entities (so `<name>` is shown, not taken for an HTML tag).
fn cell(s: &str) -> String {
    let one_line = s.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut out = String::new();
    for (i, part) in one_line.split('`').enumerate() {
        if i > 0 {
            out.push('`');
        }
        if i % 2 == 0 {
            out.push_str(&part.replace('<', "&lt;").replace('>', "&gt;"));
        } else {
            out.push_str(part);
        }
    }
    out.replace('|', "\\|")
}

// ---------------------------------------------------------------- manifest keys

/// The manifest key tables, from the JSON Schema.
pub(crate) fn manifest_keys(schema: &Json) -> String {
    let defs = schema["$defs"].as_object().expect("$defs");
    let paths = def_paths(schema);
    let mut out = String::new();
    out.push_str(
        "Types link to the table of the object they name. *Required* keys must be given; \
         the others take the default shown (— when absent means not set).\n\n",
    );
    out.push_str("### The file\n\nThe top level of a manifest file.\n\n");
    object_table(&mut out, schema, defs);
    for (name, def) in defs {
        let _ = write!(out, "\n### {name}\n\n");
        if let Some(p) = paths.get(name) {
            let _ = writeln!(out, "Where: `{p}`.\n");
        }
        if let Some(d) = def.get("description").and_then(Json::as_str) {
            let _ = writeln!(out, "{}\n", cell(d));
        }
        if def.get("properties").is_some() {
            object_table(&mut out, def, defs);
        } else if let Some(values) = consts(def) {
            out.push_str("| value | meaning |\n|---|---|\n");
            for (v, d) in values {
                let _ = writeln!(out, "| `{v}` | {} |", cell(&d));
            }
        } else if let Some(variants) = def.get("oneOf").and_then(Json::as_array) {
            out.push_str("Exactly one of:\n\n");
            for v in variants {
                if let Some(d) = v.get("description").and_then(Json::as_str) {
                    let _ = writeln!(out, "{}\n", cell(d));
                }
                object_table(&mut out, v, defs);
                out.push('\n');
            }
        } else {
            let _ = writeln!(out, "A {}.", ty(def));
        }
    }
    out
}

fn object_table(out: &mut String, obj: &Json, defs: &serde_json::Map<String, Json>) {
    let required: BTreeSet<&str> = obj["required"]
        .as_array()
        .map(|a| a.iter().filter_map(Json::as_str).collect())
        .unwrap_or_default();
    out.push_str("| key | type | required | default | allowed values | description |\n");
    out.push_str("|---|---|---|---|---|---|\n");
    for (key, p) in obj["properties"].as_object().expect("properties") {
        let default = match p.get("default") {
            Some(Json::Null) | None => "—".to_owned(),
            Some(v) => format!("`{v}`"),
        };
        let _ = writeln!(
            out,
            "| `{key}` | {} | {} | {default} | {} | {} |",
            ty(p),
            if required.contains(key.as_str()) {
                "yes"
            } else {
                "no"
            },
            allowed(p, defs),
            cell(p.get("description").and_then(Json::as_str).unwrap_or("")),
        );
    }
}

/// `(value, description)` of a `oneOf` made only of constants.
fn consts(def: &Json) -> Option<Vec<(String, String)>> {
    def.get("oneOf")?
        .as_array()?
        .iter()
        .map(|v| {
            Some((
                v.get("const")?.as_str()?.to_owned(),
                v.get("description")
                    .and_then(Json::as_str)
                    .unwrap_or("")
                    .to_owned(),
            ))
        })
        .collect()
}

fn def_link(r: &str) -> String {
    let name = r.trim_start_matches("#/$defs/");
    format!("[{name}](#{})", name.to_lowercase())
}

/// A readable type.
fn ty(p: &Json) -> String {
    if let Some(r) = p.get("$ref").and_then(Json::as_str) {
        return def_link(r);
    }
    if let Some(any) = p
        .get("anyOf")
        .or_else(|| p.get("oneOf"))
        .and_then(Json::as_array)
    {
        return any.iter().map(ty).collect::<Vec<_>>().join(" or ");
    }
    let one = |t: &str| -> String {
        match t {
            "array" => format!(
                "list of {}",
                p.get("items").map(ty).unwrap_or_else(|| "any".into())
            ),
            "object" => match p.get("additionalProperties") {
                Some(Json::Bool(true)) | None => "map".to_owned(),
                Some(Json::Bool(false)) => "object".to_owned(),
                Some(v) => format!("map of {}", ty(v)),
            },
            "integer" if p.get("minimum").is_some() => "integer ≥ 0".to_owned(),
            other => other.to_owned(),
        }
    };
    match p.get("type") {
        Some(Json::String(t)) => one(t),
        Some(Json::Array(ts)) => {
            let names: Vec<String> = ts
                .iter()
                .filter_map(Json::as_str)
                .filter(|t| *t != "null")
                .map(one)
                .collect();
            names.join(" or ")
        }
        _ => "any".to_owned(),
    }
}

fn allowed(p: &Json, defs: &serde_json::Map<String, Json>) -> String {
    if let Some(e) = p.get("enum").and_then(Json::as_array) {
        return e
            .iter()
            .map(|v| {
                format!(
                    "`{}`",
                    v.as_str().map(str::to_owned).unwrap_or(v.to_string())
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
    }
    // A reference to a set of constants (`Outcome`, `ProviderName`): its values.
    p.get("$ref")
        .and_then(Json::as_str)
        .and_then(|r| defs.get(r.trim_start_matches("#/$defs/")))
        .and_then(consts)
        .map(|values| {
            values
                .iter()
                .map(|(v, _)| format!("`{v}`"))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default()
}

/// The first YAML path at which each definition is used, e.g. `sagas[].triggers[]`.
fn def_paths(schema: &Json) -> BTreeMap<String, String> {
    fn walk(v: &Json, path: &str, out: &mut BTreeMap<String, String>, defs: &Json) {
        if let Some(r) = v.get("$ref").and_then(Json::as_str) {
            let name = r.trim_start_matches("#/$defs/").to_owned();
            if out.contains_key(&name) {
                return;
            }
            out.insert(name.clone(), path.to_owned());
            walk(&defs[&name], path, out, defs);
            return;
        }
        if let Some(props) = v.get("properties").and_then(Json::as_object) {
            for (k, p) in props {
                let sep = if path.is_empty() { "" } else { "." };
                walk(p, &format!("{path}{sep}{k}"), out, defs);
            }
        }
        if let Some(items) = v.get("items") {
            walk(items, &format!("{path}[]"), out, defs);
        }
        if let Some(ap) = v.get("additionalProperties").filter(|a| a.is_object()) {
            walk(ap, &format!("{path}.<name>"), out, defs);
        }
        for key in ["anyOf", "oneOf"] {
            for alt in v.get(key).and_then(Json::as_array).into_iter().flatten() {
                walk(alt, path, out, defs);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(schema, "", &mut out, &schema["$defs"]);
    out
}

// ---------------------------------------------------------------- configuration keys

/// One key of `config/default.toml`: section, key, its comment, and whether it is only
/// shown commented out (an optional key, unset by default).
#[derive(Debug, Clone)]
pub(crate) struct TomlKey {
    pub(crate) section: String,
    pub(crate) key: String,
    pub(crate) comment: String,
}

/// The keys of `config/default.toml`, in order, with the comment lines above each.
pub(crate) fn default_toml_keys() -> Vec<TomlKey> {
    let text = std::fs::read_to_string(root().join("config/default.toml")).expect("default.toml");
    let mut out: Vec<TomlKey> = Vec::new();
    let mut section = String::new();
    let mut comment: Vec<String> = Vec::new();
    // The last key of this section with a comment of its own: a key written right below
    // it without one shares it.
    let mut group_head: Option<String> = None;
    for line in text.lines() {
        let t = line.trim();
        if let Some(s) = t.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            section = s.to_owned();
            comment.clear();
            group_head = None;
            continue;
        }
        // `key = value`, or `# key = value` for an optional key shown commented out.
        let candidate = t.strip_prefix('#').map(str::trim).unwrap_or(t);
        let is_key = !section.is_empty()
            && candidate.split_once(" = ").is_some_and(|(k, _)| {
                !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            });
        if is_key {
            let (k, v) = candidate.split_once(" = ").expect("checked");
            let inline = v.split_once(" # ").map(|(_, c)| c.trim().to_owned());
            let mut text = comment.join(" ");
            if let Some(c) = inline {
                text = if text.is_empty() {
                    c
                } else {
                    format!("{text} ({c})")
                };
            }
            if text.is_empty()
                && let Some(head) = &group_head
            {
                text = format!("See `{head}`.");
            } else if !comment.is_empty() {
                group_head = Some(k.to_owned());
            }
            out.push(TomlKey {
                section: section.clone(),
                key: k.to_owned(),
                comment: text,
            });
            comment.clear();
        } else if let Some(c) = t.strip_prefix('#') {
            comment.push(c.trim().to_owned());
        } else if t.is_empty() {
            comment.clear();
            group_head = None;
        }
    }
    out
}

/// Every `(section, key)` of `Config::default()`, with its default as JSON.
pub(crate) fn struct_keys() -> BTreeMap<(String, String), Json> {
    let cfg = serde_json::to_value(runner::config::Config::default()).expect("config serializes");
    let mut out = BTreeMap::new();
    for (section, keys) in cfg.as_object().expect("sections") {
        for (key, v) in keys.as_object().expect("keys") {
            out.insert((section.clone(), key.clone()), v.clone());
        }
    }
    out
}

fn toml_value(v: &Json) -> String {
    match v {
        Json::Null => "*unset*".to_owned(),
        Json::String(s) => format!("`\"{s}\"`"),
        Json::Array(items) => format!(
            "`[{}]`",
            items
                .iter()
                .map(|i| match i {
                    Json::String(s) => format!("\"{s}\""),
                    other => other.to_string(),
                })
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => format!("`{other}`"),
    }
}

/// The configuration key tables.
pub(crate) fn config_keys() -> String {
    let defaults = struct_keys();
    let mut out = String::new();
    let mut section = String::new();
    for k in default_toml_keys() {
        let Some(default) = defaults.get(&(k.section.clone(), k.key.clone())) else {
            continue; // reported by the key-set test
        };
        if k.section != section {
            section = k.section.clone();
            let _ = write!(
                out,
                "\n### `[{section}]`\n\n| key | default | environment | meaning |\n|---|---|---|---|\n"
            );
        }
        let env = format!(
            "{}{}__{}",
            runner::config::ENV_PREFIX,
            k.section.to_uppercase(),
            k.key.to_uppercase()
        );
        let _ = writeln!(
            out,
            "| `{}` | {} | `{env}` | {} |",
            k.key,
            toml_value(default),
            cell(&k.comment)
        );
    }
    out.trim_start().to_owned()
}

// ---------------------------------------------------------------- metrics

/// `(name, kind, labels, help)` of every metric defined in the source.
pub(crate) fn metrics() -> Vec<(String, String, Vec<String>, String)> {
    let mut out = Vec::new();
    // (where the names are defined, where the collectors are made: a file, or every file
    // of a folder, one family of metrics each)
    for (file, made_in) in [
        ("src/telemetry/names.rs", "src/telemetry/families"),
        ("src/broker/liveness.rs", "src/broker/liveness.rs"),
    ] {
        let text = std::fs::read_to_string(root().join(file)).expect("source");
        let made = source_text(&root().join(made_in));
        let mut doc: Vec<String> = Vec::new();
        for line in text.lines() {
            let t = line.trim();
            if let Some(d) = t.strip_prefix("///") {
                doc.push(d.trim().to_owned());
                continue;
            }
            if let Some(rest) = t.strip_prefix("pub const ")
                && let Some((cname, value)) = rest.split_once(": &str = \"")
                && value.starts_with("runner_")
            {
                let name = value.trim_end_matches("\";").to_owned();
                let (kind, labels, help) = shape(&made, cname);
                // The doc of the name, unless it only says what the constant is.
                let doc = doc.join(" ");
                let meaning = if doc.starts_with("Name of") {
                    help
                } else {
                    doc
                };
                out.push((name, kind, labels, meaning));
            }
            doc.clear();
        }
    }
    out
}

/// The text of a source file, or of every `.rs` file of a folder in name order.
fn source_text(path: &std::path::Path) -> String {
    if !path.is_dir() {
        return std::fs::read_to_string(path).expect("source");
    }
    let mut files: Vec<_> = std::fs::read_dir(path)
        .expect("folder")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|f| std::fs::read_to_string(f).expect("source"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The collector kind and labels of the metric whose name constant is `cname`, from the
/// statement that creates it.
fn shape(text: &str, cname: &str) -> (String, Vec<String>, String) {
    // Where the collector is created: the first use of the constant after its definition
    // (in telemetry, after the doc links of the `Metrics` fields: inside `Metrics::new`).
    let def = format!("pub const {cname}:");
    let mut from = text.find(&def).map(|d| d + def.len()).unwrap_or(0);
    if text.contains("pub struct Metrics")
        && let Some(n) = text.find("pub fn new(")
    {
        from = from.max(n);
    }
    // The first use in code, not in a comment that names it.
    let in_comment = |at: usize| {
        let line = text[..at].rfind('\n').map_or(0, |n| n + 1);
        text[line..at].trim_start().starts_with("//")
    };
    let Some(at) = text[from..]
        .match_indices(cname)
        .map(|(a, _)| a + from)
        .find(|a| !in_comment(*a))
    else {
        return ("?".into(), Vec::new(), String::new());
    };
    let start = text[..at].rfind("let ").unwrap_or(0);
    let end = text[at..].find("?;").map(|e| at + e).unwrap_or(text.len());
    let stmt = &text[start..end];
    let kind = if stmt.contains("hist(") || stmt.contains("Histogram") {
        "histogram"
    } else if stmt.contains("Counter") || stmt.contains("counters(") {
        "counter"
    } else {
        "gauge"
    };
    let labels = stmt
        .find("&[\"")
        .map(|i| {
            let s = &stmt[i + 2..];
            let e = s.find(']').unwrap_or(s.len());
            s[..e]
                .split(',')
                .map(|l| l.trim().trim_matches('"').to_owned())
                .filter(|l| !l.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let help = stmt[at - start..]
        .split('"')
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    (kind.to_owned(), labels, help)
}

/// The metrics table.
pub(crate) fn metrics_table() -> String {
    let mut out = String::from("| metric | kind | labels | meaning |\n|---|---|---|---|\n");
    for (name, kind, labels, help) in metrics() {
        let labels = if labels.is_empty() {
            "—".to_owned()
        } else {
            labels
                .iter()
                .map(|l| format!("`{l}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(out, "| `{name}` | {kind} | {labels} | {} |", cell(&help));
    }
    out
}

// ---------------------------------------------------------------- retry waits

fn ms(v: u64) -> String {
    if v < 1000 {
        format!("{v} ms")
    } else if v.is_multiple_of(1000) {
        format!("{} s", v / 1000)
    } else {
        format!("{:.1} s", v as f64 / 1000.0)
    }
}

/// The table of retry waits, computed with `runner::saga::retry::backoff_ms`.
pub(crate) fn retry_table() -> String {
    use runner::manifest::model::RetryPolicy;
    let policies = [
        (10, 30_000),
        (50, 5_000),
        (100, 5_000),
        (100, 30_000),
        (200, 30_000),
        (500, 60_000),
        (1_000, 60_000),
    ];
    let mut out = String::from(
        "| `base_backoff` | `max_backoff` | retry 1 | retry 2 | retry 3 | retry 4 | retry 5 | all waits, `retry_limit: 3` | all waits, `retry_limit: 5` |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for (base, max) in policies {
        let p = RetryPolicy {
            retry_limit: 5,
            base_backoff: Some(base),
            max_backoff: max,
            enable_jitter: false,
        };
        let waits: Vec<u64> = (1..=5)
            .map(|n| runner::saga::retry::backoff_ms(&p, n))
            .collect();
        let _ = writeln!(
            out,
            "| {base} | {max} | {} | {} | {} |",
            waits.iter().map(|w| ms(*w)).collect::<Vec<_>>().join(" | "),
            ms(waits[..3].iter().sum()),
            ms(waits.iter().sum()),
        );
    }
    out
}

/// The shipped sagas (`manifests/`) drawn with `runner graph`'s Mermaid output, newest
/// version of each, in name order.
pub(crate) fn saga_diagrams() -> String {
    use runner::manifest::graph::{Diagram, Format};
    let report = runner::manifest::load(&[root().join("manifests")]);
    let catalog = report.catalog.expect("the shipped manifests load");
    let mut out = String::new();
    for name in catalog.saga_names() {
        let saga = catalog.newest(name).expect("a loaded saga");
        let _ = write!(
            out,
            "### `{}` (version {}, {})\n\n```mermaid\n{}```\n\n",
            saga.name,
            saga.version,
            match saga.style() {
                runner::manifest::catalog::Style::StateMachine => "state machine",
                runner::manifest::catalog::Style::Orchestration => "orchestration",
            },
            Diagram::of(saga).render(Format::Mermaid)
        );
    }
    out
}
