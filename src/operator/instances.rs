//! `runner inspect` and `runner instances list`: one instance, or one page of instances,
//! read from the data directory or through a node's admin API; printed escaped, or as JSON.

use super::store::{open_store_read_only, remote};
use crate::cli::{InstancesAction, OutputFormat, StoreArgs};

/// `runner inspect`: one instance with its timers and recent transitions.
pub fn inspect(
    args: &StoreArgs,
    tenant: &str,
    saga: &str,
    id: &str,
    output: OutputFormat,
) -> anyhow::Result<()> {
    let view = if let Some(api) = remote(args)? {
        use crate::admin::client::enc;
        api.get(&format!(
            "/admin/instance?tenant={}&saga={}&id={}",
            enc(tenant),
            enc(saga),
            enc(id)
        ))?
    } else {
        let (_, store) = open_store_read_only(args)?;
        serde_json::to_value(crate::ops::inspect(&store, tenant, saga, id)?)?
    };
    if output == OutputFormat::Json {
        crate::outln!("{}", serde_json::to_string_pretty(&view)?)?;
        return Ok(());
    }
    let e = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => crate::telemetry::escape_controls(s).into_owned(),
        other => other.to_string(),
    };
    let i = &view["instance"];
    crate::outln!(
        "{}/{}/{}\tstate {}\tstatus {}\tversion {}\tinputs {}",
        e(&i["tenant"]),
        e(&i["saga"]),
        e(&i["correlation_id"]),
        e(&i["state"]),
        e(&i["status"]),
        i["version"],
        i["applied"]
    )?;
    if let Some(first) = view["parked_by"].as_u64() {
        crate::outln!("parked behind dead letter {first}")?;
    }
    for t in view["timers"].as_array().into_iter().flatten() {
        crate::outln!("timer {}\tdue_ms {}", e(&t["name"]), t["due_ms"])?;
    }
    for h in view["recent_transitions"].as_array().into_iter().flatten() {
        crate::outln!(
            "{}\t{}\t{} -> {}\tat_ms {}\toutputs {}",
            h["n"],
            e(&h["event"]),
            e(&h["from"]),
            e(&h["to"]),
            h["at_ms"],
            h["emitted"]
        )?;
    }
    Ok(())
}

/// `runner instances list`: one page of a tenant's instances of a saga.
pub fn instances(args: &StoreArgs, action: InstancesAction) -> anyhow::Result<()> {
    let InstancesAction::List {
        tenant,
        saga,
        state,
        older_than,
        limit,
        after,
        output,
    } = action;
    let older_than_ms = older_than.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let page: serde_json::Value = match remote(args)? {
        Some(api) => {
            use crate::admin::client::enc;
            let mut q = format!("tenant={}&saga={}&limit={limit}", enc(&tenant), enc(&saga));
            if let Some(s) = &state {
                q += &format!("&state={}", enc(s));
            }
            if let Some(ms) = older_than_ms {
                q += &format!("&older_than={ms}ms");
            }
            if let Some(a) = &after {
                q += &format!("&after={}", enc(a));
            }
            api.get(&format!("/admin/instances?{q}"))?
        }
        None => {
            // With replicas, this store may also keep stale copies of partitions other
            // nodes own now: `--admin URL` lists what that node owns.
            let (_, store) = open_store_read_only(args)?;
            serde_json::to_value(crate::ops::list_instances(
                &store,
                &crate::ops::Listing {
                    tenant: &tenant,
                    saga: &saga,
                    state: state.as_deref(),
                    older_than_ms,
                    after: after.as_deref(),
                    limit,
                },
                &|_| true,
            )?)?
        }
    };
    if output == OutputFormat::Json {
        crate::outln!("{}", serde_json::to_string_pretty(&page)?)?;
        return Ok(());
    }
    let e = |v: &serde_json::Value| -> String {
        let text = match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        crate::telemetry::escape_controls(&text).into_owned()
    };
    for i in page["items"].as_array().into_iter().flatten() {
        crate::outln!(
            "{}\t{}\t{}\tv{}\tstarted {}\tupdated {}\t{} inputs",
            e(&i["correlation_id"]),
            e(&i["state"]),
            e(&i["status"]),
            i["version"],
            i["started_ms"],
            i["updated_ms"],
            i["inputs_applied"]
        )?;
    }
    if let Some(next) = page["next"].as_str() {
        crate::outln!("next: {next}")?;
    }
    Ok(())
}
