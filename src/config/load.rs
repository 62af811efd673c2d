//! Layered loading: defaults, then the TOML file, then environment, then CLI flags.
//!
//! Guarantee: a loaded config is validated and every error points at its source. A problem
//! in the file carries its line and column and key path; a problem in the environment names
//! the variable that caused it (variables are applied in sorted order and checked one by
//! one); the merged result then goes through [`Config::validate`] before it is returned.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::Config;
use super::error::ConfigError;
use crate::cli::Mode;

/// Prefix of environment variables that override config keys: `RUNNER__NATS__URLS` sets
/// `nats.urls`.
pub const ENV_PREFIX: &str = "RUNNER__";

/// Values given on the command line; each replaces the config value when present.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    /// `--mode`.
    pub mode: Option<Mode>,
    /// `--manifest` (replaces the whole list when non-empty).
    pub manifests: Vec<PathBuf>,
    /// `--nats-url` (replaces the whole list when non-empty).
    pub nats_urls: Vec<String>,
    /// `--admin-addr`.
    pub admin_addr: Option<SocketAddr>,
    /// `--data-dir`.
    pub data_dir: Option<PathBuf>,
}

/// Loads the config: defaults, `file` (if any), the given environment variables (pass
/// `std::env::vars()`), then `overrides`; then validates.
pub fn load(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
    overrides: &Overrides,
) -> Result<Config, ConfigError> {
    let mut file_text: Option<(&Path, String)> = None;
    let mut table = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.to_path_buf(),
                source,
            })?;
            // First pass over the text itself, so errors carry line and column.
            let de = toml::de::Deserializer::parse(&text)
                .map_err(|e| file_error(path, &text, None, &e))?;
            serde_path_to_error::deserialize::<_, Config>(de).map_err(|e| {
                let key = e.path().to_string();
                file_error(path, &text, Some(key), e.inner())
            })?;
            let table = toml::from_str::<toml::Table>(&text)
                .map_err(|e| file_error(path, &text, None, &e))?;
            file_text = Some((path, text));
            table
        }
        None => toml::Table::new(),
    };
    // Which variable set each key, so a validation error can name where a value came from.
    let mut from_env: std::collections::HashMap<String, String> = Default::default();

    let mut env_vars: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX))
        .collect();
    env_vars.sort();
    for (var, raw) in &env_vars {
        let path: Vec<String> = var[ENV_PREFIX.len()..]
            .split("__")
            .map(|p| p.to_ascii_lowercase())
            .collect();
        if path.iter().any(String::is_empty) {
            return Err(ConfigError::Env {
                var: var.clone(),
                key: None,
                message: "expected RUNNER__SECTION__KEY".into(),
            });
        }
        // The value verbatim first: every string key (secrets, names, paths, durations,
        // sizes, comma-separated lists) takes it exactly as given, whatever it looks like
        // (`12345678`, `true`, `"quoted"`). Only when the key is not a string is the value
        // read as TOML (numbers, booleans, arrays).
        let verbatim = toml::Value::String(raw.clone());
        let mut tried = table.clone();
        set_path(&mut tried, &path, verbatim).map_err(|message| ConfigError::Env {
            var: var.clone(),
            key: Some(path.join(".")),
            message,
        })?;
        from_env.insert(path.join("."), var.clone());
        if check_table(&tried).is_ok() {
            table = tried;
            continue;
        }
        set_path(&mut table, &path, parse_env_value(raw)).map_err(|message| ConfigError::Env {
            var: var.clone(),
            key: Some(path.join(".")),
            message,
        })?;
        // Check after each variable so an error names the variable that caused it. The
        // message never repeats the value: it may be a secret given to the wrong key.
        check_table(&table).map_err(|(key, message)| ConfigError::Env {
            var: var.clone(),
            key: Some(key),
            message: without_value(&message, raw),
        })?;
    }

    let mut config: Config = match check_table(&table) {
        Ok(c) => c,
        // Only reachable when the file parsed alone but not as a table (never, in practice).
        Err((key, message)) => return Err(ConfigError::Invalid { key, message }),
    };

    if let Some(mode) = overrides.mode {
        config.runner.mode = mode;
    }
    if !overrides.manifests.is_empty() {
        config.runner.manifests = overrides.manifests.clone();
    }
    if !overrides.nats_urls.is_empty() {
        config.nats.urls = overrides.nats_urls.clone();
    }
    if let Some(addr) = overrides.admin_addr {
        config.admin.addr = addr;
    }
    if let Some(dir) = &overrides.data_dir {
        config.storage.data_dir = dir.clone();
    }
    config.source = file.map(Path::to_path_buf);
    // Relative paths in a config file are relative to the working directory, like the CLI's.
    config.validate().map_err(|e| match e {
        // Say where the refused value was written.
        ConfigError::Invalid { key, message } => {
            if let Some(var) = from_env.get(&key) {
                return ConfigError::Env {
                    var: var.clone(),
                    key: Some(key),
                    message,
                };
            }
            match file_text
                .as_ref()
                .and_then(|(path, text)| locate(text, &key).map(|at| (path, at)))
            {
                Some((path, (line, column))) => ConfigError::File {
                    path: path.to_path_buf(),
                    line,
                    column,
                    key: Some(key),
                    message,
                },
                None => ConfigError::Invalid { key, message },
            }
        }
        other => other,
    })?;
    Ok(config)
}

/// Line and column where `key` (`section.name`, or deeper: `tenancy.rate_limits.acme`) is
/// written in a TOML text, if it is: in a `[section]`, a dotted key or an inline table. A key
/// whose parent is not a table there is placed at that parent.
fn locate(text: &str, key: &str) -> Option<(usize, usize)> {
    let doc = toml::de::DeTable::parse(text).ok()?;
    let mut table = doc.get_ref();
    let mut segments = key.split('.').peekable();
    while let Some(segment) = segments.next() {
        let (k, v) = table
            .iter()
            .find(|(k, _)| k.get_ref().as_ref() == segment)?;
        match v.get_ref() {
            toml::de::DeValue::Table(inner) if segments.peek().is_some() => table = inner,
            _ => return Some(line_col(text, k.span().start)),
        }
    }
    None
}

fn check_table(table: &toml::Table) -> Result<Config, (String, String)> {
    let value = toml::Value::Table(table.clone());
    serde_path_to_error::deserialize::<_, Config>(value)
        .map_err(|e| (e.path().to_string(), e.inner().message().to_string()))
}

/// `message` with every occurrence of the environment value `raw` replaced by a mark.
fn without_value(message: &str, raw: &str) -> String {
    if raw.is_empty() {
        return message.to_string();
    }
    message.replace(raw, "<value>")
}

/// For a key that is not a string: the environment value read as a TOML value when it is
/// one (`5`, `true`, `["a"]`), else as a plain string (which then fails with the key's
/// expected type).
fn parse_env_value(raw: &str) -> toml::Value {
    #[derive(Deserialize)]
    struct Wrapper {
        v: toml::Value,
    }
    match toml::from_str::<Wrapper>(&format!("v = {raw}")) {
        Ok(w) => w.v,
        Err(_) => toml::Value::String(raw.to_string()),
    }
}

fn set_path(table: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), String> {
    let (last, parents) = path.split_last().ok_or("empty key")?;
    let mut cur = table;
    for p in parents {
        let entry = cur
            .entry(p.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry
            .as_table_mut()
            .ok_or_else(|| format!("`{p}` is not a section"))?;
    }
    cur.insert(last.clone(), value);
    Ok(())
}

fn file_error(path: &Path, text: &str, key: Option<String>, e: &toml::de::Error) -> ConfigError {
    let (line, column) = e.span().map(|s| line_col(text, s.start)).unwrap_or((0, 0));
    ConfigError::File {
        path: path.to_path_buf(),
        line,
        column,
        key,
        message: e.message().trim().to_string(),
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::config::HumanDuration;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("tempfile");
        f.write_all(text.as_bytes()).expect("write");
        f
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn unknown_key_names_file_line_and_key() {
        let f = file("[nats]\nurls = [\"nats://127.0.0.1:4222\"]\nconect_timeout = \"5s\"\n");
        match load(Some(f.path()), env(&[]), &Overrides::default()) {
            Err(ConfigError::File {
                line,
                column,
                key,
                message,
                ..
            }) => {
                assert_eq!((line, column), (3, 1));
                assert_eq!(key.as_deref(), Some("nats.conect_timeout"));
                assert!(message.contains("conect_timeout"), "{message}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn a_bad_value_inside_an_inline_table_is_placed_at_its_key() {
        let f = file(
            "[tenancy]\nweights = { a = 2 }\neffect_rate_limits.b = { ping = 1.0, pong = 0.0 }\n",
        );
        match load(Some(f.path()), env(&[]), &Overrides::default()) {
            Err(ConfigError::File {
                line, column, key, ..
            }) => {
                assert_eq!(key.as_deref(), Some("tenancy.effect_rate_limits.b.pong"));
                assert_eq!((line, column), (3, 38));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn bad_duration_names_the_key() {
        let f = file("[runner]\ndrain_timeout = \"soon\"\n");
        match load(Some(f.path()), env(&[]), &Overrides::default()) {
            Err(ConfigError::File { line, key, .. }) => {
                assert_eq!(line, 2);
                assert_eq!(key.as_deref(), Some("runner.drain_timeout"));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn env_overrides_file_and_cli_overrides_env() {
        let f = file("[nats]\nconnect_timeout = \"5s\"\n[streams]\nreplicas = 1\n");
        let vars = env(&[
            ("RUNNER__NATS__CONNECT_TIMEOUT", "7s"),
            ("RUNNER__STREAMS__REPLICAS", "3"),
            ("RUNNER__NATS__URLS", "nats://a:4222,nats://b:4222"),
            ("UNRELATED", "x"),
        ]);
        let cli = Overrides {
            nats_urls: vec!["nats://c:4222".into()],
            ..Overrides::default()
        };
        let c = load(Some(f.path()), vars.clone(), &Overrides::default()).expect("loads");
        assert_eq!(c.nats.connect_timeout, HumanDuration::secs(7));
        assert_eq!(c.streams.replicas, 3);
        assert_eq!(c.nats.urls, vec!["nats://a:4222", "nats://b:4222"]);
        let c = load(Some(f.path()), vars, &cli).expect("loads");
        assert_eq!(c.nats.urls, vec!["nats://c:4222"]);
    }

    #[test]
    fn unknown_env_key_names_the_variable() {
        match load(
            None,
            env(&[("RUNNER__NATS__NOPE", "1")]),
            &Overrides::default(),
        ) {
            Err(ConfigError::Env { var, key, .. }) => {
                assert_eq!(var, "RUNNER__NATS__NOPE");
                assert_eq!(key.as_deref(), Some("nats.nope"));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn range_errors_come_after_layering() {
        match load(
            None,
            env(&[("RUNNER__STREAMS__REPLICAS", "9")]),
            &Overrides::default(),
        ) {
            Err(ConfigError::Env { key, var, .. }) => {
                assert_eq!(key.as_deref(), Some("streams.replicas"));
                assert_eq!(var, "RUNNER__STREAMS__REPLICAS");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn default_toml_matches_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/default.toml");
        let mut c = load(Some(&path), env(&[]), &Overrides::default()).expect("default.toml loads");
        assert_eq!(c.source.as_deref(), Some(path.as_path()));
        c.source = None;
        assert_eq!(
            c,
            Config::default(),
            "config/default.toml drifted from Config::default()"
        );
    }

    #[test]
    fn string_keys_take_environment_values_verbatim() {
        let c = load(
            None,
            env(&[
                ("RUNNER__NATS__USER", "true"),
                ("RUNNER__NATS__PASSWORD", "12345678"),
                ("RUNNER__NATS__CLIENT_NAME", "\"abc\""),
                ("RUNNER__ADMIN__TOKEN", "1_000_000_000_000_000"),
                ("RUNNER__STREAMS__REPLICAS", "3"),
                ("RUNNER__PARTITIONS__ENABLED", "true"),
            ]),
            &Overrides::default(),
        )
        .expect("loads");
        assert_eq!(c.nats.user.as_deref(), Some("true"));
        assert_eq!(c.nats.password.as_deref(), Some("12345678"));
        assert_eq!(c.nats.client_name, "\"abc\"");
        assert_eq!(c.admin.token.as_deref(), Some("1_000_000_000_000_000"));
        assert_eq!(c.streams.replicas, 3);
        assert_eq!(c.partitions.enabled, Some(true));
    }

    #[test]
    fn a_type_error_from_the_environment_does_not_repeat_the_value() {
        let secret = "hunter2-not-a-number";
        match load(
            None,
            env(&[("RUNNER__STREAMS__REPLICAS", secret)]),
            &Overrides::default(),
        ) {
            Err(e @ ConfigError::Env { .. }) => {
                let shown = e.to_string();
                assert!(shown.contains("RUNNER__STREAMS__REPLICAS"), "{shown}");
                assert!(!shown.contains(secret), "{shown}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn credentials_in_urls_and_several_schemes_are_refused_without_echoing_them() {
        for url in [
            "nats://alice:s3cret-pw@127.0.0.1:4222",
            "nats://s3cret-pw@127.0.0.1:4222",
        ] {
            match load(
                None,
                env(&[("RUNNER__NATS__URLS", url)]),
                &Overrides::default(),
            ) {
                Err(e @ ConfigError::Env { .. }) => {
                    let shown = e.to_string();
                    assert!(shown.contains("nats.urls"), "{shown}");
                    assert!(!shown.contains("s3cret-pw"), "{shown}");
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        let both = env(&[
            ("RUNNER__NATS__TOKEN", "t0ken-value-123"),
            ("RUNNER__NATS__USER", "u"),
            ("RUNNER__NATS__PASSWORD", "p"),
        ]);
        match load(None, both, &Overrides::default()) {
            Err(ConfigError::Env { key, message, .. }) => {
                assert_eq!(key.as_deref(), Some("nats.token"));
                assert!(message.contains("nats.user"), "{message}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn odd_node_ids_are_refused() {
        for id in ["a.b", "a b", "x*", "new\nline", &"n".repeat(65)] {
            match load(
                None,
                env(&[("RUNNER__NODE__ID", id)]),
                &Overrides::default(),
            ) {
                Err(ConfigError::Env { key, .. }) => assert_eq!(key.as_deref(), Some("node.id")),
                other => panic!("{id:?}: unexpected {other:?}"),
            }
        }
        let ok = load(
            None,
            env(&[("RUNNER__NODE__ID", "node-1_a")]),
            &Overrides::default(),
        );
        assert_eq!(ok.expect("loads").node.id, "node-1_a");
    }

    #[test]
    fn validation_errors_name_the_file_line_or_the_variable() {
        let f = file("[streams]\nreplicas = 9\n");
        match load(Some(f.path()), env(&[]), &Overrides::default()) {
            Err(ConfigError::File {
                line, column, key, ..
            }) => {
                assert_eq!((line, column), (2, 1));
                assert_eq!(key.as_deref(), Some("streams.replicas"));
            }
            other => panic!("unexpected {other:?}"),
        }
        match load(
            Some(f.path()),
            env(&[("RUNNER__STREAMS__REPLICAS", "7")]),
            &Overrides::default(),
        ) {
            Err(ConfigError::Env { var, .. }) => assert_eq!(var, "RUNNER__STREAMS__REPLICAS"),
            other => panic!("unexpected {other:?}"),
        }
    }
}
