//! The committed JSON Schema (`schema/manifest.schema.json`) matches the manifest model.
//!
//! Regenerate after changing `src/manifest/model.rs`:
//! `UPDATE_SCHEMA=1 cargo test --test manifest_schema`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

#[test]
fn committed_schema_is_up_to_date() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("schema/manifest.schema.json");
    let generated = serde_json::to_string_pretty(&runner::manifest::json_schema()).unwrap() + "\n";
    if std::env::var_os("UPDATE_SCHEMA").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "schema/manifest.schema.json is out of date; regenerate it with \
         `UPDATE_SCHEMA=1 cargo test --test manifest_schema` and commit the result"
    );
}

#[test]
fn schema_describes_the_top_level_and_saga_fields() {
    let schema = runner::manifest::json_schema();
    let props = &schema["properties"];
    for key in ["format", "effects", "sagas"] {
        assert!(props.get(key).is_some(), "missing {key}");
    }
    let saga = &schema["$defs"]["SagaDecl"]["properties"];
    for key in [
        "name",
        "version",
        "triggers",
        "initial_state",
        "states",
        "steps",
        "migration",
        "data",
    ] {
        assert!(saga.get(key).is_some(), "SagaDecl lacks {key}: {saga}");
    }
    assert_eq!(
        schema["$defs"]["SagaDecl"]["properties"]["name"]["type"],
        "string"
    );
}

#[test]
fn schema_lists_exactly_the_providers_the_compiler_knows() {
    let schema = runner::manifest::json_schema();
    let provider = &schema["$defs"]["ProviderName"];
    let mut listed: Vec<String> = provider["oneOf"]
        .as_array()
        .map(|alts| {
            alts.iter()
                .filter_map(|a| a["const"].as_str().or_else(|| a["enum"][0].as_str()))
                .map(str::to_string)
                .collect()
        })
        .or_else(|| {
            provider["enum"].as_array().map(|e| {
                e.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
        })
        .unwrap_or_default();
    listed.sort();
    let mut known: Vec<String> = runner::manifest::PROVIDERS
        .iter()
        .map(|p| p.to_string())
        .collect();
    known.sort();
    assert_eq!(listed, known, "schema: {provider}");
}
