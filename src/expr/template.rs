//! Templates: JSON built from a YAML value tree with `${ expr }` holes.
//!
//! A string that is exactly one `${ expr }` takes the expression's value (any JSON type); a
//! string with `${ … }` among other text interpolates each value as text; `$${` writes a
//! literal `${`. Every other value is copied as written. A template is compiled once, at
//! load, so rendering never parses and inherits the determinism of its expressions.

use serde_json::Value as Json;

use super::error::ExprError;
use super::needs::Needs;
use super::{Expr, Vars};

/// A JSON-building template, compiled from a YAML value tree (see the module docs).
#[derive(Debug, Clone)]
pub enum Template {
    /// A value copied as written.
    Literal(Json),
    /// A string that is exactly one `${ expr }`: the expression's JSON value.
    Expr(Expr),
    /// A string mixing text and expressions, rendered as a string.
    Interpolate(Vec<Piece>),
    /// A list of templates.
    List(Vec<Template>),
    /// An object of templates (keys are literal), in the keys' byte order, each key once:
    /// build it with [`Template::object`].
    Object(Vec<(String, Template)>),
}

/// One part of an interpolated string.
#[derive(Debug, Clone)]
pub enum Piece {
    /// Literal text.
    Text(String),
    /// An expression rendered as text.
    Expr(Expr),
}

impl Template {
    /// Compiles a template string: literal, a single expression, or an interpolation.
    pub fn compile_str(s: &str) -> Result<Template, ExprError> {
        let pieces = split_template(s)?;
        Ok(match pieces.as_slice() {
            [] => Template::Literal(Json::String(String::new())),
            [RawPiece::Text(t)] => Template::Literal(Json::String(t.clone())),
            [RawPiece::Expr(e)] => Template::Expr(Expr::compile(e)?),
            _ => Template::Interpolate(
                pieces
                    .into_iter()
                    .map(|p| match p {
                        RawPiece::Text(t) => Ok(Piece::Text(t)),
                        RawPiece::Expr(e) => Expr::compile(&e).map(Piece::Expr),
                    })
                    .collect::<Result<_, _>>()?,
            ),
        })
    }

    /// An object template. Fields are put in the keys' byte order (the order a JSON object
    /// is written in); of two fields with the same key the later one is kept, as when
    /// building the object field by field.
    pub fn object(mut fields: Vec<(String, Template)>) -> Template {
        fields.reverse();
        fields.sort_by(|a, b| a.0.cmp(&b.0));
        fields.dedup_by(|later, earlier| later.0 == earlier.0);
        Template::Object(fields)
    }

    /// Adds what this template's expressions read to `needs`.
    pub fn add_needs(&self, needs: &mut Needs) {
        match self {
            Template::Literal(_) => {}
            Template::Expr(e) => needs.merge(e.needs()),
            Template::Interpolate(pieces) => {
                for p in pieces {
                    if let Piece::Expr(e) = p {
                        needs.merge(e.needs());
                    }
                }
            }
            Template::List(items) => items.iter().for_each(|t| t.add_needs(needs)),
            Template::Object(fields) => fields.iter().for_each(|(_, t)| t.add_needs(needs)),
        }
    }

    /// Whether this template contains no expression at all.
    pub fn is_literal(&self) -> bool {
        matches!(self, Template::Literal(_))
    }

    /// Builds the JSON value.
    pub fn render(&self, vars: &Vars<'_>) -> Result<Json, ExprError> {
        Ok(match self {
            Template::Literal(v) => v.clone(),
            Template::Expr(e) => e.eval(vars)?,
            Template::Interpolate(pieces) => {
                let mut out = String::new();
                for p in pieces {
                    match p {
                        Piece::Text(t) => out.push_str(t),
                        Piece::Expr(e) => match e.eval(vars)? {
                            Json::String(s) => out.push_str(&s),
                            other => out.push_str(&other.to_string()),
                        },
                    }
                }
                Json::String(out)
            }
            Template::List(items) => Json::Array(
                items
                    .iter()
                    .map(|t| t.render(vars))
                    .collect::<Result<_, _>>()?,
            ),
            Template::Object(fields) => {
                let mut out = serde_json::Map::new();
                for (k, t) in fields {
                    out.insert(k.clone(), t.render(vars)?);
                }
                Json::Object(out)
            }
        })
    }
}

impl Template {
    /// Writes the value [`Template::render`] builds, as JSON text, straight into `out`:
    /// the same bytes as serializing the rendered value, without building it. Plain paths
    /// are written from the variables they point into, not copied first.
    pub fn write(&self, vars: &Vars<'_>, out: &mut Vec<u8>) -> Result<(), ExprError> {
        match self {
            Template::Literal(v) => put(out, v),
            Template::Expr(e) => {
                if !e.write_path(vars, out) {
                    put(out, &e.eval(vars)?);
                }
            }
            Template::Interpolate(_) => put(out, &self.render(vars)?),
            Template::List(items) => {
                out.push(b'[');
                for (i, t) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    t.write(vars, out)?;
                }
                out.push(b']');
            }
            Template::Object(fields) => {
                out.push(b'{');
                for (i, (k, t)) in fields.iter().enumerate() {
                    debug_assert!(i == 0 || fields[i - 1].0 < *k, "template keys out of order");
                    if i > 0 {
                        out.push(b',');
                    }
                    put(out, k);
                    out.push(b':');
                    t.write(vars, out)?;
                }
                out.push(b'}');
            }
        }
        Ok(())
    }
}

/// Serializes into a byte buffer, which cannot fail for JSON values and strings.
fn put<T: serde::Serialize + ?Sized>(out: &mut Vec<u8>, v: &T) {
    let _ = serde_json::to_writer(out, v);
}

enum RawPiece {
    Text(String),
    Expr(String),
}

fn split_template(s: &str) -> Result<Vec<RawPiece>, ExprError> {
    let mut out = Vec::new();
    let mut text = String::new();
    let mut rest = s;
    while let Some(pos) = rest.find("${") {
        if pos > 0 && rest[..pos].ends_with('$') {
            // `$${` is an escaped literal `${`.
            text.push_str(&rest[..pos - 1]);
            text.push_str("${");
            rest = &rest[pos + 2..];
            continue;
        }
        text.push_str(&rest[..pos]);
        let after = &rest[pos + 2..];
        let end = find_close(after).ok_or(ExprError::Unterminated)?;
        if !text.is_empty() {
            out.push(RawPiece::Text(std::mem::take(&mut text)));
        }
        out.push(RawPiece::Expr(after[..end].trim().to_string()));
        rest = &after[end + 1..];
    }
    text.push_str(rest);
    if !text.is_empty() {
        out.push(RawPiece::Text(text));
    }
    Ok(out)
}

/// Finds the `}` closing a `${`, skipping braces and quoted strings inside the expression.
fn find_close(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '"' | '\'' => quote = Some(c),
            '{' => depth += 1,
            '}' if depth == 0 => return Some(i),
            '}' => depth -= 1,
            _ => {}
        }
    }
    None
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn templates() {
        let event = json!({"aggregate_id": "o-1", "payload": {"amount": 5}});
        let state = json!({});
        let saga = json!({});
        let vars = Vars::new(&event, &state, &saga);
        let t = Template::compile_str("${ event.payload.amount }").unwrap();
        assert_eq!(t.render(&vars).unwrap(), json!(5));
        let t = Template::compile_str("order-${event.aggregate_id}/${ {'a': 1}['a'] }").unwrap();
        assert_eq!(t.render(&vars).unwrap(), json!("order-o-1/1"));
        let t = Template::compile_str("cost $${x}").unwrap();
        assert_eq!(t.render(&vars).unwrap(), json!("cost ${x}"));
        assert!(matches!(
            Template::compile_str("${ event"),
            Err(ExprError::Unterminated)
        ));
    }

    #[test]
    fn written_text_is_the_rendered_value_serialized() {
        let event =
            json!({"name": "n\"q", "payload": {"items": [{"z": 1, "a": [true, null]}], "n": 7}});
        let state = json!({"total": 2.5});
        let saga = json!({});
        let vars = Vars::new(&event, &state, &saga);
        let e = |s: &str| Template::compile_str(s).unwrap();
        // Keys given out of order, one twice (the later one counts, as when rendering);
        // `last` ends the list under `m`.
        let object = |last: &str| {
            Template::object(vec![
                ("z".into(), e("${ event.payload.items }")),
                ("b".into(), e("first")),
                ("a".into(), e("${ state.total + 1.0 }")),
                ("b".into(), e("id-${ event.payload.n }")),
                (
                    "m".into(),
                    Template::List(vec![e("${ event.name }"), e(last)]),
                ),
            ])
        };
        let t = object("${ state.missing }");
        let mut out = Vec::new();
        let written = t.write(&vars, &mut out);
        // `state.missing` is the interpreter's error, in both forms.
        assert!(written.is_err() && t.render(&vars).is_err());
        let t = object("${ 'lit' }");
        let mut out = Vec::new();
        t.write(&vars, &mut out).unwrap();
        let rendered = t.render(&vars).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), rendered.to_string());
        assert_eq!(rendered["b"], json!("id-7"));
    }
}
