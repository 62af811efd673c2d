//! `runner dlq`: dead letters listed, shown, redriven and purged, against a data directory
//! or a node's admin API.
//!
//! Guarantees: only purge opens the data directory for writing; the dead-letter stream and
//! a redrive go through a running node (a redrive is the partition owner's to make), and
//! without `--admin` they are refused with the reason. Values printed are escaped: they may
//! come from inputs.

use super::store::{open_store, open_store_read_only, remote};
use crate::cli::{DlqAction, OutputFormat, StoreArgs};

/// `runner dlq`: dead letters listed, shown, redriven, purged.
pub fn dlq(args: &StoreArgs, action: DlqAction) -> anyhow::Result<()> {
    if let Some(api) = remote(args)? {
        return ops_dlq_remote(&api, action);
    }
    if matches!(
        action,
        DlqAction::List { stream: true, .. } | DlqAction::Redrive { stream: true, .. }
    ) {
        anyhow::bail!("the dead-letter stream is read through a running node: add --admin URL");
    }
    if let DlqAction::Redrive { tenant, id, .. } = &action {
        return redrive_here(args, tenant, *id);
    }
    let (_, store) = if matches!(action, DlqAction::Purge { .. }) {
        open_store(args)?
    } else {
        open_store_read_only(args)?
    };
    match action {
        DlqAction::List { stream: true, .. } => {
            anyhow::bail!("the dead-letter stream is read through a running node: add --admin URL");
        }
        DlqAction::List {
            tenant,
            all,
            limit,
            after,
            output,
            ..
        } => {
            let page = crate::deadletter::page(
                &store,
                &crate::deadletter::Listing {
                    tenant: tenant.as_deref(),
                    all,
                    after: after.as_deref(),
                    limit,
                },
            )?;
            print_letters(&page, output)?;
        }
        DlqAction::Show { tenant, id, output } => {
            let letter = crate::deadletter::show(&store, &tenant, id)?;
            print_letter(&serde_json::to_value(letter)?, output)?;
        }
        DlqAction::Purge {
            tenant,
            older_than,
            kind,
            force,
            dry_run,
        } => {
            let older_than = older_than
                .map(|d| {
                    d.parse::<crate::config::HumanDuration>()
                        .map_err(|e| anyhow::anyhow!("--older-than {d:?}: {e}"))
                })
                .transpose()?;
            let p = crate::deadletter::Purge {
                tenant,
                before_ms: older_than
                    .map(|d| crate::clock::now_ms().saturating_sub(d.get().as_millis() as u64)),
                kind,
                force,
                dry_run,
            };
            let gone = crate::deadletter::purge(&store, &p)?;
            let e = crate::telemetry::escape_controls;
            for d in &gone {
                crate::outln!(
                    "{}\t{}\t{}\t{:?}\t{}",
                    d.id,
                    e(&d.tenant),
                    d.kind,
                    d.status,
                    e(&d.source)
                )?;
            }
            let verb = if dry_run {
                "would be removed"
            } else {
                "removed"
            };
            crate::outln!("{} dead letter(s) {verb}", gone.len())?;
        }
        DlqAction::Redrive { tenant, id, .. } => redrive_here(args, &tenant, id)?,
    }
    Ok(())
}

/// `runner dlq` against a running node's admin API.
fn ops_dlq_remote(
    api: &crate::admin::client::AdminClient,
    action: DlqAction,
) -> anyhow::Result<()> {
    use crate::admin::client::enc;
    match action {
        DlqAction::List {
            tenant,
            stream: true,
            limit,
            after,
            output,
            ..
        } => {
            let mut q = format!("limit={limit}");
            if let Some(t) = &tenant {
                q += &format!("&tenant={}", enc(t));
            }
            if let Some(a) = &after {
                q += &format!("&after={}", enc(a));
            }
            let v = api.get(&format!("/admin/dlq/stream?{q}"))?;
            if output == OutputFormat::Json {
                crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
                return Ok(());
            }
            let e = |v: &serde_json::Value| {
                crate::telemetry::escape_controls(v.as_str().unwrap_or("-")).into_owned()
            };
            let items = v["items"].as_array().cloned().unwrap_or_default();
            for i in &items {
                let l = &i["letter"];
                crate::outln!(
                    "{}\t{}\t{}\t{}\t{}",
                    i["seq"],
                    e(&l["tenant_id"]),
                    e(&l["kind"]),
                    e(&l["subject"]),
                    e(&l["reason"])
                )?;
            }
            crate::outln!("{} dead letter(s) on stream {}", items.len(), v["stream"])?;
            print_next(&v)?;
        }
        DlqAction::List {
            tenant,
            all,
            limit,
            after,
            output,
            ..
        } => {
            let mut q = format!("limit={limit}&all={all}");
            if let Some(t) = &tenant {
                q += &format!("&tenant={}", enc(t));
            }
            if let Some(a) = &after {
                q += &format!("&after={}", enc(a));
            }
            let v = api.get(&format!("/admin/dlq?{q}"))?;
            let page: crate::deadletter::Page = serde_json::from_value(v)?;
            print_letters(&page, output)?;
        }
        DlqAction::Show { tenant, id, output } => {
            let v = api.get(&format!("/admin/dlq/{}/{id}", enc(&tenant)))?;
            print_letter(&v, output)?;
        }
        DlqAction::Redrive { tenant, id, stream } => {
            let path = if stream {
                format!("/admin/dlq/stream/{}/{id}/redrive", enc(&tenant))
            } else {
                format!("/admin/dlq/{}/{id}/redrive", enc(&tenant))
            };
            let v = api.post(&path, &serde_json::json!({}))?;
            crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
        }
        DlqAction::Purge { .. } => {
            anyhow::bail!("dlq purge works on a data directory (--data-dir), not through --admin")
        }
    }
    Ok(())
}

/// `runner dlq redrive` without `--admin`: refused, naming why. A redrive writes state and
/// outputs into a partition: only its owner does that, in the partition's log and under its
/// fences. An effect command's letter is never a saga input: that is said, as a node would.
fn redrive_here(args: &StoreArgs, tenant: &str, id: u64) -> anyhow::Result<()> {
    if let Ok((_, store)) = open_store_read_only(args)
        && let Ok(letter) = crate::deadletter::show(&store, tenant, id)
        && crate::deadletter::is_effect_command(&letter)
    {
        return Err(crate::deadletter::DeadLetterError::EffectCommand(id).into());
    }
    anyhow::bail!(
        "a dead letter is redriven by its partition's owner: run this with --admin URL of that \
         node (the letter stays pending)"
    )
}

/// Prints one dead letter: JSON, or one `field: value` line each (values escaped).
fn print_letter(v: &serde_json::Value, output: OutputFormat) -> anyhow::Result<()> {
    if output == OutputFormat::Json {
        crate::outln!("{}", serde_json::to_string_pretty(v)?)?;
        return Ok(());
    }
    for (k, val) in v.as_object().into_iter().flatten() {
        let text = match val {
            serde_json::Value::String(s) => crate::telemetry::escape_controls(s).into_owned(),
            other => other.to_string(),
        };
        crate::outln!("{k}: {text}")?;
    }
    Ok(())
}

/// Prints a page of dead letters one line each (values escaped: they may come from
/// inputs), a count, and `next: …` when more follow; or the page as one JSON document.
fn print_letters(page: &crate::deadletter::Page, output: OutputFormat) -> anyhow::Result<()> {
    if output == OutputFormat::Json {
        crate::outln!("{}", serde_json::to_string_pretty(page)?)?;
        return Ok(());
    }
    let e = crate::telemetry::escape_controls;
    for d in page.items.iter().map(|l| &l.letter) {
        crate::outln!(
            "{}\t{}\t{}\t{:?}\t{}\t{}/{}\t{}",
            d.id,
            e(&d.tenant),
            e(&d.kind),
            d.status,
            e(&d.source),
            e(d.saga.as_deref().unwrap_or("-")),
            e(d.correlation_id.as_deref().unwrap_or("-")),
            e(&d.reason)
        )?;
    }
    crate::outln!("{} dead letter(s)", page.items.len())?;
    print_next(&serde_json::to_value(page)?)
}

/// The end of a printed page: `next: …` when more follow, and why the page is short when it
/// stopped before its `limit` (its answer's byte cap, or its scan bound).
fn print_next(page: &serde_json::Value) -> anyhow::Result<()> {
    if let Some(next) = page["next"].as_str() {
        if let Some(why) = page["stopped_at"].as_str() {
            crate::outln!(
                "page stopped at its {}; more may follow",
                crate::telemetry::escape_controls(why)
            )?;
        }
        crate::outln!("next: {}", crate::telemetry::escape_controls(next))?;
    }
    Ok(())
}
