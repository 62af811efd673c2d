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
//!
//! Inside (each file states its own guarantee):
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`Expr`] (compile, evaluate) and [`Vars`] (the three variables of one evaluation) |
//! | `checker.rs` | the static determinism checks run by [`Expr::compile`] |
//! | `needs.rs` | [`Needs`]: what an expression can read, and binding only that |
//! | `path.rs` | plain field paths, read from the JSON without the interpreter |
//! | `convert.rs` | JSON ↔ CEL values ([`json_to_val`], [`cel_to_json`], [`type_name`]) |
//! | `template.rs` | [`Template`]: JSON with `${ expr }` holes |
//! | `error.rs` | [`ExprError`] |

use std::cell::OnceCell;
use std::fmt;
use std::sync::{Arc, LazyLock};

use cel::common::ast::IdedExpr;
use cel::{Context, Env, Program, Value};
use serde_json::Value as Json;

mod checker;
mod convert;
mod error;
mod needs;
mod path;
mod template;
mod yields;

pub use checker::ROOTS;
pub use convert::{cel_to_json, json_to_val, type_name};
pub use error::ExprError;
pub use needs::Needs;
pub use template::{Piece, Template};
pub use yields::Yields;

/// The CEL environment every expression compiles and runs in: the standard library without
/// the `chrono` feature, so there is no clock, no randomness and no I/O.
static ENV: LazyLock<Arc<Env>> = LazyLock::new(|| Arc::new(Env::stdlib()));

/// A compiled CEL expression.
#[derive(Clone)]
pub struct Expr {
    source: Arc<str>,
    program: Arc<Program>,
    /// Ranges of order-producing comprehensions, checked to be lists before evaluation.
    ordered_ranges: Arc<[IdedExpr]>,
    /// The parts of `event`, `state` and `saga` this expression can read.
    needs: Needs,
    /// Set when the expression is a plain field path, answered without the interpreter.
    path: Option<Arc<path::Path>>,
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
        let ordered_ranges = checker::check(program.expression(), &ENV)?;
        let needs = Needs::of(program.expression());
        let path = path::Path::of(program.expression()).map(Arc::new);
        Ok(Self {
            source: source.into(),
            program: Arc::new(program),
            ordered_ranges: ordered_ranges.into(),
            needs,
            path,
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

    /// Whether this expression is a plain field path (`state.x.y`), which is read straight
    /// from the JSON when the field is there (see `path.rs`).
    pub fn is_path(&self) -> bool {
        self.path.is_some()
    }

    /// Evaluates over `vars` and converts the result to JSON.
    pub fn eval(&self, vars: &Vars<'_>) -> Result<Json, ExprError> {
        if let Some(path) = &self.path
            && let Some(v) = path.read(vars.event, vars.extra, vars.state, vars.saga)
        {
            return Ok(v);
        }
        self.eval_program(vars)
    }

    /// Writes this expression's value as JSON text when it is a plain path that finds its
    /// field; `false` (nothing written) when the caller must evaluate it.
    pub(crate) fn write_path(&self, vars: &Vars<'_>, out: &mut Vec<u8>) -> bool {
        let Some(path) = &self.path else {
            return false;
        };
        let written = match path.find(vars.event, vars.extra, vars.state, vars.saga) {
            Some(path::Found::Json(v)) => serde_json::to_writer(out, v),
            Some(path::Found::Str(s)) => serde_json::to_writer(out, s),
            None => return false,
        };
        written.is_ok()
    }

    /// Evaluates with the interpreter, whatever the expression is.
    fn eval_program(&self, vars: &Vars<'_>) -> Result<Json, ExprError> {
        let ctx = vars.ctx();
        for range in self.ordered_ranges.iter() {
            match Value::resolve(range, ctx) {
                Ok(Value::Map(_)) => {
                    return Err(ExprError::MapIteration(
                        "map/filter applied to a map".into(),
                    ));
                }
                Ok(_) => {}
                Err(e) => return Err(eval_error(e)),
            }
        }
        let value = self.program.execute(ctx).map_err(eval_error)?;
        cel_to_json(&value)
    }

    /// What the value can be, as far as the syntax tells (`yields.rs`).
    pub fn yields(&self) -> Yields {
        yields::of(self.program.expression())
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

/// Every part of every variable, for callers that bind the variables whole.
static EVERYTHING: LazyLock<Needs> = LazyLock::new(Needs::everything);

/// The variables of one evaluation, borrowing the JSON they were built from.
///
/// The CEL values are built on first use: an evaluation that only reads plain field paths
/// never converts anything.
pub struct Vars<'v> {
    event: &'v Json,
    extra: &'v [(&'v str, &'v str)],
    state: &'v Json,
    saga: &'v Json,
    needs: &'v Needs,
    ctx: OnceCell<Context<'v, 'v>>,
}

impl<'v> Vars<'v> {
    /// Binds `event`, `state` and `saga` in full.
    pub fn new(event: &'v Json, state: &'v Json, saga: &'v Json) -> Self {
        Self::pruned(event, &[], state, saga, &EVERYTHING)
    }

    /// Binds only the parts of the variables that `needs` lists (see [`Needs`]), with extra
    /// string fields added to the `event` object (when it is one) — nothing is copied.
    ///
    /// Any expression whose needs are included in `needs` evaluates exactly as with
    /// [`Vars::new`]: what is left out is what it can never read.
    pub fn pruned(
        event: &'v Json,
        extra: &'v [(&'v str, &'v str)],
        state: &'v Json,
        saga: &'v Json,
        needs: &'v Needs,
    ) -> Self {
        Self {
            event,
            extra,
            state,
            saga,
            needs,
            ctx: OnceCell::new(),
        }
    }

    /// The CEL context, built the first time an expression needs the interpreter.
    fn ctx(&self) -> &Context<'v, 'v> {
        self.ctx.get_or_init(|| {
            let mut ctx = Context::with_env(ENV.clone());
            let [event, state, saga] = self
                .needs
                .bind(self.event, self.extra, self.state, self.saga);
            ctx.add_variable_as_val("event", event);
            ctx.add_variable_as_val("state", state);
            ctx.add_variable_as_val("saga", saga);
            ctx
        })
    }
}

/// A run-time failure of the interpreter as an [`ExprError`]: a missing field is told apart.
fn eval_error(e: cel::ExecutionError) -> ExprError {
    match e {
        cel::ExecutionError::NoSuchKey(k) => ExprError::Missing(k.to_string()),
        other => ExprError::Eval(other.to_string()),
    }
}
