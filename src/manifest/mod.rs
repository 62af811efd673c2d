//! Manifests: the sagas and effects an operator declares in YAML files.
//!
//! Loading is all-or-nothing: [`load`] reads every file under the given paths and returns
//! either a complete [`Catalog`] or the full list of problems found (each with file, line
//! and column). Nothing half-loaded is ever handed to the rest of the runner, so a reload
//! that fails keeps the previous catalog in force.
//!
//! This module is the stable interface the rest of the binary uses (`runner validate`,
//! `/admin/reload`, `/info`). Inside:
//!
//! | module | role |
//! |---|---|
//! | [`model`] | the file format (serde + schemars; keeps line/column of names and expressions) |
//! | `loader` | listing and reading the files, sorting the diagnostics |
//! | `compile` | every check of `runner validate`; builds the catalog |
//! | [`catalog`] | the compiled, immutable form the engine ([`crate::saga`]) executes |
//!
//! Test-case files (`*.tests.yaml`) live beside manifests and are skipped by [`load`].
//! Before swapping catalogs, the service should call [`Catalog::stranded`] with the
//! (saga, version) pairs of its in-flight instances and refuse a reload that strands any.

use std::fmt;
use std::path::PathBuf;

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;

pub mod catalog;
mod compile;
pub mod graph;
mod loader;
mod millis;
pub mod model;

pub use compile::{DEFAULT_STEP_TIMEOUT_MS, PROVIDERS};
pub use loader::{collect_files, is_test_file, load, load_str, with_manifests_beside};

/// A check of one effect's provider settings: `Err((setting, message))` names the setting
/// (a dotted path such as `request.amount`, located in the file when it is reported) and
/// says what is wrong with it.
pub type SettingsCheck = fn(&catalog::Effect) -> Result<(), (String, String)>;

static SETTINGS_CHECK: std::sync::OnceLock<SettingsCheck> = std::sync::OnceLock::new();

/// Registers the provider-settings check every load runs on every effect of a known
/// provider (the effect worker owns the providers; this module sits below it, so the check
/// is handed down once at start-up rather than imported). The first registration stays.
pub fn set_settings_check(check: SettingsCheck) {
    let _ = SETTINGS_CHECK.set(check);
}

fn settings_check() -> Option<SettingsCheck> {
    SETTINGS_CHECK.get().copied()
}

/// The manifest format version this build understands.
pub const FORMAT_VERSION: u32 = 1;

/// How bad a [`Diagnostic`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The manifest set cannot be used.
    Error,
    /// The manifest set is usable but probably not what the author meant.
    Warning,
}

/// One problem found in a manifest file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Diagnostic {
    /// The file the problem is in.
    pub file: PathBuf,
    /// 1-based line, 0 when unknown.
    pub line: u64,
    /// 1-based column, 0 when unknown.
    pub column: u64,
    /// Error or warning.
    pub severity: Severity,
    /// What is wrong, in one sentence.
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        write!(
            f,
            "{}:{}:{}: {sev}: {}",
            self.file.display(),
            self.line,
            self.column,
            self.message
        )
    }
}

/// A validated set of manifests, ready to run: every version of every saga, and the effects.
///
/// Immutable once built; share it behind an `Arc` and swap the whole catalog on reload.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    files: Vec<PathBuf>,
    sagas: BTreeMap<String, BTreeMap<u32, Arc<catalog::Saga>>>,
    effects: BTreeMap<String, Arc<catalog::Effect>>,
}

/// What `/info` shows of a [`Catalog`].
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct CatalogSummary {
    /// Files the catalog was loaded from.
    pub files: Vec<String>,
    /// Saga names with their loaded version.
    pub sagas: Vec<SagaSummary>,
    /// Effect names.
    pub effects: Vec<String>,
}

/// One loaded saga version.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct SagaSummary {
    /// Saga name.
    pub name: String,
    /// Saga version.
    pub version: u32,
    /// How the saga is written.
    pub style: catalog::Style,
}

impl Catalog {
    /// A catalog with nothing in it.
    pub fn empty() -> Self {
        Self::default()
    }

    /// The names and versions shown by `/info`.
    pub fn summary(&self) -> CatalogSummary {
        CatalogSummary {
            files: self.files.iter().map(|f| f.display().to_string()).collect(),
            sagas: self
                .sagas
                .values()
                .flat_map(|versions| versions.values())
                .map(|s| SagaSummary {
                    name: s.name.clone(),
                    version: s.version,
                    style: s.style(),
                })
                .collect(),
            effects: self.effects.keys().cloned().collect(),
        }
    }

    /// One version of a saga.
    pub fn saga(&self, name: &str, version: u32) -> Option<&Arc<catalog::Saga>> {
        self.sagas.get(name)?.get(&version)
    }

    /// The newest loaded version of a saga: the one new instances start on.
    pub fn newest(&self, name: &str) -> Option<&Arc<catalog::Saga>> {
        self.sagas.get(name)?.values().next_back()
    }

    /// Every loaded saga version, by name then version.
    pub fn sagas(&self) -> impl Iterator<Item = &Arc<catalog::Saga>> {
        self.sagas.values().flat_map(|v| v.values())
    }

    /// The loaded versions of one saga, oldest first.
    pub fn versions(&self, name: &str) -> impl DoubleEndedIterator<Item = &Arc<catalog::Saga>> {
        self.sagas.get(name).into_iter().flat_map(|v| v.values())
    }

    /// Names of the loaded sagas.
    pub fn saga_names(&self) -> impl Iterator<Item = &str> {
        self.sagas.keys().map(String::as_str)
    }

    /// The subject patterns (relative to the tenant, tokens joined by `.`) of every
    /// trigger of every loaded saga version: what the routers need to read.
    pub fn trigger_patterns(&self) -> impl Iterator<Item = String> + '_ {
        self.sagas
            .values()
            .flat_map(|versions| versions.values())
            .flat_map(|saga| saga.triggers.iter())
            .map(|t| t.pattern.join("."))
    }

    /// Whether some loaded version of saga `name` emits effect commands.
    pub fn starts_effects(&self, name: &str) -> bool {
        self.versions(name).any(|s| s.starts_effects)
    }

    /// Names of the declared effects.
    pub fn effect_names(&self) -> impl Iterator<Item = &str> {
        self.effects.keys().map(String::as_str)
    }

    /// A declared effect.
    pub fn effect(&self, name: &str) -> Option<&Arc<catalog::Effect>> {
        self.effects.get(name)
    }

    /// The (saga, version) pairs in `in_use` (versions of in-flight instances) that this
    /// catalog does not load. Loading it would strand those instances: every later input
    /// of theirs would be refused as `version_not_loaded`. A version stays loaded until its
    /// instances are migrated (`runner migrate`), even when the next version declares a
    /// migration from it: nothing migrates an instance implicitly.
    pub fn stranded(&self, in_use: &[(String, u32)]) -> Vec<Stranded> {
        in_use
            .iter()
            .filter(|(name, version)| self.saga(name, *version).is_none())
            .map(|(name, version)| Stranded {
                saga: name.clone(),
                version: *version,
                migratable: version
                    .checked_add(1)
                    .and_then(|next| self.saga(name, next))
                    .is_some_and(|s| s.migration.as_ref().is_some_and(|m| m.from == *version)),
            })
            .collect()
    }
}

impl Stranded {
    /// The problem as a diagnostic (no file: it concerns stored instances).
    pub fn to_diagnostic(&self) -> Diagnostic {
        Diagnostic {
            file: PathBuf::from("<store>"),
            line: 0,
            column: 0,
            severity: Severity::Error,
            message: self.to_string(),
        }
    }
}

/// An in-use saga version that a catalog does not load.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Stranded {
    /// Saga name.
    pub saga: String,
    /// The version in use.
    pub version: u32,
    /// Whether the next version, loaded, declares a migration from this one (so the
    /// instances can be migrated while both are loaded).
    pub migratable: bool,
}

impl fmt::Display for Stranded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (saga, v) = (&self.saga, self.version);
        write!(
            f,
            "saga `{saga}` version {v} has instances in flight but is not loaded; "
        )?;
        if self.migratable {
            write!(
                f,
                "keep version {v} loaded beside version {}, migrate them with `runner migrate \
                 --saga {saga} --from {v}` (for each tenant), then drop it",
                v + 1
            )
        } else {
            write!(
                f,
                "keep it loaded until they finish (no loaded version declares a migration from it)"
            )
        }
    }
}

/// The result of [`load`]: a catalog when there were no errors, and every diagnostic found.
#[derive(Debug)]
pub struct LoadReport {
    /// `Some` exactly when no diagnostic is an error.
    pub catalog: Option<Catalog>,
    /// Every problem found, errors and warnings, in file order.
    pub diagnostics: Vec<Diagnostic>,
}

impl LoadReport {
    /// The diagnostics that are errors.
    pub fn errors(&self) -> impl Iterator<Item = &Diagnostic> {
        self.diagnostics
            .iter()
            .filter(|d| d.severity == Severity::Error)
    }
}

/// A serde-saphyr error's text without the location it repeats (the diagnostic carries it).
pub fn yaml_message(e: &serde_saphyr::Error) -> String {
    let text = e.to_string();
    let first = text.lines().next().unwrap_or_default();
    let rest = first.strip_prefix("error: ").unwrap_or(first);
    let msg = match rest.strip_prefix("line ").and_then(|r| r.split_once(": ")) {
        Some((loc, msg)) if loc.contains("column") => msg,
        _ => rest,
    };
    // Advice about parser options is for library users, not manifest authors.
    msg.split(", set DuplicateKeyPolicy")
        .next()
        .unwrap_or(msg)
        .to_string()
}

/// The JSON Schema of the manifest format, generated from [`model::ManifestFile`].
///
/// Committed as `schema/manifest.schema.json` for editors (YAML language servers use it for
/// completion and checks); a test fails when the committed copy is out of date.
pub fn json_schema() -> serde_json::Value {
    let mut schema = schemars::schema_for!(model::ManifestFile).to_value();
    if let serde_json::Value::Object(m) = &mut schema {
        m.insert(
            "$id".into(),
            serde_json::Value::String("https://runner.dev/schema/manifest.schema.json".into()),
        );
    }
    schema
}
