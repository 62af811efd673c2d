//! Diagnostics of the compiler: where a problem is recorded and how it is located.
//!
//! Guarantee: recording a problem never stops the compiler. Every check pushes a
//! [`Diagnostic`] with the file, line and column of the value it concerns and carries on,
//! so one run of `runner validate` lists everything that is wrong.

use std::path::Path;

use serde_saphyr::Location;

use crate::manifest::model::Sp;
use crate::manifest::{Diagnostic, Severity};

/// Collects diagnostics for one file.
pub(super) struct Diags<'a> {
    pub(super) file: &'a Path,
    pub(super) out: &'a mut Vec<Diagnostic>,
}

impl Diags<'_> {
    fn push(&mut self, severity: Severity, at: Location, message: String) {
        self.out.push(Diagnostic {
            file: self.file.to_path_buf(),
            line: at.line(),
            column: at.column(),
            severity,
            message,
        });
    }
    pub(super) fn error(&mut self, at: Location, message: impl Into<String>) {
        self.push(Severity::Error, at, message.into());
    }
    pub(super) fn warn(&mut self, at: Location, message: impl Into<String>) {
        self.push(Severity::Warning, at, message.into());
    }
}

/// Where a spanned value was written (its first character).
pub(super) fn at<T>(s: &Sp<T>) -> Location {
    s.referenced
}
