//! Expressions: a thin, deterministic wrapper around CEL (crate `cel`).
//!
//! Every expression in a manifest (guards, correlation ids, payload templates, timer times,
//! migrations) is compiled once, at load, into an [`Expr`]. Evaluation sees exactly three
//! variables, built by the caller as JSON: `event` (the input envelope with its payload),
//! `state` (the saga instance's data) and `saga` (name, tenant, correlation id, version,
//! current state). Nothing else is reachable: the standard CEL library is used without the
//! `chrono` feature, so there is no clock, no randomness and no I/O.
//!
//! Guarantees:
//! - **Same inputs, same output.** JSON objects become CEL maps, whose iteration order is
//!   not stable across processes; so a comprehension that produces an ordered result
//!   (`map`, `filter`) over a map is refused — at compile time when the range is a map
//!   literal or one of the known objects (`event`, `state`, `saga`), and at evaluation time
//!   (a typed [`ExprError::MapIteration`]) when the range turns out to be a map. Two-variable
//!   comprehensions (which only make sense over maps) are refused at compile time.
//! - **Integers stay integers.** JSON numbers that fit an `i64` become CEL `int` (so
//!   `x + 1` works), larger unsigned ones `uint`, everything else `double`. Results convert
//!   back into JSON the same way; a non-finite double is an error, never a silent `null`.
//!
//! Templates ([`Template`]) build JSON from a YAML value tree: a string that is exactly one
//! `${ expr }` takes the expression's value (any JSON type); a string with `${ … }` among
//! other text interpolates each value as text; `$${` writes a literal `${`. Every other value
//! is copied as written.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, LazyLock};

use cel::common::ast::{EntryExpr, Expr as Ast, IdedExpr};
use cel::common::types::{
    CelBool, CelDouble, CelInt, CelList, CelMap, CelMapKey, CelNull, CelString, CelUInt,
};
use cel::common::value::Val;
use cel::{Context, Env, Program, Value};
use serde_json::Value as Json;

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

static ENV: LazyLock<Arc<Env>> = LazyLock::new(|| Arc::new(Env::stdlib()));

/// Why an expression could not be compiled or evaluated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExprError {
    /// The text is not valid CEL. `line`/`column` are inside the expression (1-based).
    #[error("syntax error at expression {line}:{column}: {message}")]
    Syntax {
        /// Line inside the expression.
        line: u32,
        /// Column inside the expression.
        column: u32,
        /// The parser's explanation.
        message: String,
    },
    /// The expression names something it cannot see.
    #[error("unknown identifier `{0}` (expressions see only event, state and saga)")]
    UnknownIdentifier(String),
    /// A comprehension whose result order would depend on map iteration order.
    #[error("comprehension over a map is not allowed (map iteration order is not stable): {0}")]
    MapIteration(String),
    /// A part of the expression that does not depend on any variable already fails.
    #[error("type error: {0}")]
    Type(String),
    /// Evaluation failed at run time (missing field, wrong type, division by zero...).
    #[error("evaluation failed: {0}")]
    Eval(String),
    /// The value cannot be represented as JSON.
    #[error("result is not JSON: {0}")]
    NotJson(String),
    /// The expression was expected to produce another type.
    #[error("expected {expected}, got {got}")]
    WrongType {
        /// What the caller needed.
        expected: &'static str,
        /// What the expression produced.
        got: String,
    },
    /// A `${` in a template has no closing `}`.
    #[error("unterminated `${{` in template string")]
    Unterminated,
}

/// A compiled CEL expression.
#[derive(Clone)]
pub struct Expr {
    source: Arc<str>,
    program: Arc<Program>,
    /// Ranges of order-producing comprehensions, checked to be lists before evaluation.
    ordered_ranges: Arc<[IdedExpr]>,
    /// The parts of `event`, `state` and `saga` this expression can read.
    needs: Needs,
}

impl fmt::Debug for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Expr").field(&self.source).finish()
    }
}

impl Expr {
    /// Compiles `source` and runs the static checks described in the module docs.
    pub fn compile(source: &str) -> Result<Self, ExprError> {
        let program = ENV.compile(source).map_err(|errs| {
            let first = errs.errors.first();
            let (line, column) = first
                .map(|e| (e.pos.0.max(1) as u32, e.pos.1.max(1) as u32))
                .unwrap_or((1, 1));
            ExprError::Syntax {
                line,
                column,
                message: first
                    .map(|e| e.msg.clone())
                    .unwrap_or_else(|| errs.to_string()),
            }
        })?;
        let mut checker = Checker::default();
        checker.walk(program.expression());
        if let Some(err) = checker.errors.into_iter().next() {
            return Err(err);
        }
        let mut needs = Needs::default();
        collect_needs(program.expression(), &mut Vec::new(), &mut needs);
        Ok(Self {
            source: source.into(),
            program: Arc::new(program),
            ordered_ranges: checker.ordered_ranges.into(),
            needs,
        })
    }

    /// The expression as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The parts of the variables this expression can read.
    pub fn needs(&self) -> &Needs {
        &self.needs
    }

    /// Evaluates over `vars` and converts the result to JSON.
    pub fn eval(&self, vars: &Vars<'_>) -> Result<Json, ExprError> {
        for range in self.ordered_ranges.iter() {
            match Value::resolve(range, &vars.ctx) {
                Ok(Value::Map(_)) => {
                    return Err(ExprError::MapIteration(
                        "map/filter applied to a map".into(),
                    ));
                }
                Ok(_) => {}
                Err(e) => return Err(ExprError::Eval(e.to_string())),
            }
        }
        let value = self
            .program
            .execute(&vars.ctx)
            .map_err(|e| ExprError::Eval(e.to_string()))?;
        cel_to_json(&value)
    }

    /// Evaluates a guard: the result must be a boolean.
    pub fn eval_bool(&self, vars: &Vars<'_>) -> Result<bool, ExprError> {
        match self.eval(vars)? {
            Json::Bool(b) => Ok(b),
            other => Err(ExprError::WrongType {
                expected: "bool",
                got: type_name(&other).into(),
            }),
        }
    }

    /// Evaluates to a string; numbers and booleans are rendered as text.
    pub fn eval_string(&self, vars: &Vars<'_>) -> Result<String, ExprError> {
        match self.eval(vars)? {
            Json::String(s) => Ok(s),
            Json::Number(n) => Ok(n.to_string()),
            Json::Bool(b) => Ok(b.to_string()),
            other => Err(ExprError::WrongType {
                expected: "string",
                got: type_name(&other).into(),
            }),
        }
    }

    /// Evaluates to a non-negative integer (e.g. milliseconds since the epoch).
    pub fn eval_u64(&self, vars: &Vars<'_>) -> Result<u64, ExprError> {
        let v = self.eval(vars)?;
        v.as_u64().ok_or_else(|| ExprError::WrongType {
            expected: "non-negative integer",
            got: type_name(&v).into(),
        })
    }
}

/// The name of a JSON value's type, for messages.
pub fn type_name(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "bool",
        Json::Number(n) if n.is_f64() => "double",
        Json::Number(_) => "int",
        Json::String(_) => "string",
        Json::Array(_) => "list",
        Json::Object(_) => "map",
    }
}

/// The variables of one evaluation, borrowing the JSON they were built from.
pub struct Vars<'v> {
    ctx: Context<'v, 'v>,
}

impl<'v> Vars<'v> {
    /// Binds `event`, `state` and `saga` in full.
    pub fn new(event: &'v Json, state: &'v Json, saga: &'v Json) -> Self {
        Self::pruned(event, &[], state, saga, &Needs::everything())
    }

    /// Binds only the parts of the variables that `needs` lists (see [`Needs`]), with extra
    /// string fields added to the `event` object (when it is one) — nothing is copied.
    ///
    /// Any expression whose needs are included in `needs` evaluates exactly as with
    /// [`Vars::new`]: what is left out is what it can never read.
    pub fn pruned(
        event: &'v Json,
        extra: &[(&'v str, &'v str)],
        state: &'v Json,
        saga: &'v Json,
        needs: &Needs,
    ) -> Self {
        let mut ctx = Context::with_env(ENV.clone());
        let event_val: Box<dyn Val + 'v> = match (event, &needs.event) {
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
        ctx.add_variable_as_val("event", event_val);
        ctx.add_variable_as_val("state", json_to_val_needed(state, &needs.state));
        ctx.add_variable_as_val("saga", json_to_val_needed(saga, &needs.saga));
        Self { ctx }
    }
}

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

    /// Adds what `other` needs.
    pub fn merge(&mut self, other: &Needs) {
        self.event.merge(&other.event);
        self.state.merge(&other.state);
        self.saga.merge(&other.saga);
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

/// Converts JSON into a CEL value without copying strings (see the module docs for numbers).
pub fn json_to_val(j: &Json) -> Box<dyn Val + '_> {
    match j {
        Json::Null => Box::new(CelNull),
        Json::Bool(b) => Box::new(CelBool::from(*b)),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Box::new(CelInt::from(i))
            } else if let Some(u) = n.as_u64() {
                Box::new(CelUInt::from(u))
            } else {
                Box::new(CelDouble::from(n.as_f64().unwrap_or(f64::NAN)))
            }
        }
        Json::String(s) => Box::new(CelString::from(s.as_str())),
        Json::Array(items) => Box::new(CelList::from(
            items.iter().map(json_to_val).collect::<Vec<_>>(),
        )),
        Json::Object(map) => {
            let m: HashMap<CelMapKey<'_>, Box<dyn Val + '_>> = map
                .iter()
                .map(|(k, v)| (CelMapKey::from(k.as_str()), json_to_val(v)))
                .collect();
            Box::new(CelMap::from(m))
        }
    }
}

/// Converts a CEL result into JSON. Map keys become strings; objects come out with sorted
/// keys (serde_json's map), so the output does not depend on CEL's map order.
pub fn cel_to_json(v: &Value) -> Result<Json, ExprError> {
    Ok(match v {
        Value::Null => Json::Null,
        Value::Bool(b) => Json::Bool(*b),
        Value::Int(i) => Json::from(*i),
        Value::UInt(u) => Json::from(*u),
        Value::Float(f) => serde_json::Number::from_f64(*f)
            .map(Json::Number)
            .ok_or_else(|| ExprError::NotJson(format!("non-finite number {f}")))?,
        Value::String(s) => Json::String(s.as_str().to_owned()),
        Value::List(items) => Json::Array(items.iter().map(cel_to_json).collect::<Result<_, _>>()?),
        Value::Map(m) => {
            let mut out = serde_json::Map::new();
            for (k, v) in m.map.iter() {
                let key = match k {
                    cel::objects::Key::String(s) => s.as_str().to_owned(),
                    cel::objects::Key::Int(i) => i.to_string(),
                    cel::objects::Key::Uint(u) => u.to_string(),
                    cel::objects::Key::Bool(b) => b.to_string(),
                };
                out.insert(key, cel_to_json(v)?);
            }
            Json::Object(out)
        }
        other => return Err(ExprError::NotJson(format!("{other:?}"))),
    })
}

#[derive(Default)]
struct Checker {
    bound: Vec<String>,
    errors: Vec<ExprError>,
    ordered_ranges: Vec<IdedExpr>,
}

impl Checker {
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
                    if let Err(err) = Value::resolve(e, &Context::with_env(ENV.clone())) {
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
    /// An object of templates (keys are literal).
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
    use super::*;
    use serde_json::json;

    fn eval(src: &str, event: Json, state: Json) -> Result<Json, ExprError> {
        let saga = json!({"name": "s"});
        let vars = Vars::new(&event, &state, &saga);
        Expr::compile(src)?.eval(&vars)
    }

    #[test]
    fn integers_are_signed_and_arithmetic_works() {
        assert_eq!(
            eval("state.n + 1", json!({}), json!({"n": 41})).unwrap(),
            json!(42)
        );
        assert_eq!(
            eval("state.x * 2.0", json!({}), json!({"x": 1.5})).unwrap(),
            json!(3.0)
        );
        assert_eq!(
            eval(
                "event.payload.amount > 10",
                json!({"payload": {"amount": 12}}),
                json!({})
            )
            .unwrap(),
            json!(true)
        );
    }

    #[test]
    fn objects_round_trip_with_sorted_keys() {
        let out = eval(
            "{'b': state.b, 'a': [1, 'x', null]}",
            json!({}),
            json!({"b": true}),
        )
        .unwrap();
        assert_eq!(
            serde_json::to_string(&out).unwrap(),
            r#"{"a":[1,"x",null],"b":true}"#
        );
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
        let err = eval("state.m.map(k, k)", json!({}), json!({"m": {"a": 1}})).unwrap_err();
        assert!(matches!(err, ExprError::MapIteration(_)));
        let ok = eval("state.m.map(k, k * 2)", json!({}), json!({"m": [1, 2]})).unwrap();
        assert_eq!(ok, json!([2, 4]));
    }

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
        for src in exprs {
            let e = Expr::compile(src).unwrap();
            let extra = [("name", "X"), ("subject", "aggregate.A.a-1")];
            let with_extra = Vars::pruned(&event, &extra, &state, &saga, &Needs::everything());
            let pruned = Vars::pruned(&event, &extra, &state, &saga, e.needs());
            let want = e.eval(&with_extra).map_err(|e| format!("{e}"));
            let got = e.eval(&pruned).map_err(|e| format!("{e}"));
            assert_eq!(want, got, "{src}");
        }
        // A field-only expression does not need the whole envelope.
        let e = Expr::compile("event.payload.n > 1").unwrap();
        assert_ne!(e.needs(), &Needs::everything());
    }
}
