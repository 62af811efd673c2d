//! The one error type of expressions and templates, for compile time and evaluation alike.
//!
//! Every way an expression can fail is a variant here, so callers (the manifest compiler,
//! the engine, the effect providers) match on the kind of failure, never on its text.

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
    /// Evaluation read a field the input or state does not have.
    #[error("evaluation failed: no such key: {0}")]
    Missing(String),
    /// Evaluation failed at run time (wrong type, division by zero...).
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
