//! Key building and value decoding shared by the tables.
//!
//! Guarantee: byte order is logical order. Numbers are big-endian; the string parts of a key
//! are separated by a 0x00 byte, which tenants, saga names and ids never contain (the saga
//! worker dead-letters an id holding one before it reaches a key), so two different keys
//! never share their bytes. A value that does not decode is reported as corrupt.

use serde::{Deserialize, Serialize};

use crate::storage::error::{Result, StorageError};

/// `meta` counter: the last outbox sequence assigned.
pub(crate) const OUTBOX_SEQ: &str = "outbox_seq";
/// `meta` counter: the last dead-letter id assigned.
pub(crate) const DEADLETTER_ID: &str = "deadletter_id";

/// Appends `parts` to `k`, separated by 0x00.
pub(super) fn push_parts(k: &mut Vec<u8>, parts: &[&str]) {
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            k.push(0);
        }
        k.extend_from_slice(p.as_bytes());
    }
}

/// The start of a key of a tenant's row in one partition (tables `live` and `capped`):
/// `tenant 0 partition:u16`.
pub(super) fn tenant_partition(tenant: &str, partition: u32) -> Result<Vec<u8>> {
    let p = u16::try_from(partition)
        .map_err(|_| StorageError::Corrupt(format!("partition {partition} is over 65535")))?;
    let mut k = Vec::with_capacity(tenant.len() + 3);
    push_parts(&mut k, &[tenant]);
    k.push(0);
    k.extend_from_slice(&p.to_be_bytes());
    Ok(k)
}

/// The tenant, the partition and what follows them in a key that starts with
/// [`tenant_partition`]; `what` names the table in the error.
pub(super) fn split_tenant_partition<'k>(
    k: &'k [u8],
    what: &str,
) -> Result<(&'k str, u32, &'k [u8])> {
    let bad = || StorageError::Corrupt(format!("{what}: malformed key"));
    // Tenants hold no 0x00 byte: the first one ends the tenant.
    let i = k.iter().position(|&b| b == 0).ok_or_else(bad)?;
    let tenant = std::str::from_utf8(&k[..i]).map_err(|_| bad())?;
    let p = k.get(i + 1..i + 3).ok_or_else(bad)?;
    Ok((
        tenant,
        u32::from(u16::from_be_bytes([p[0], p[1]])),
        &k[i + 3..],
    ))
}

/// Key of a saga instance (also of its parked marker).
pub fn instance_key(tenant: &str, saga: &str, correlation_id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(tenant.len() + saga.len() + correlation_id.len() + 2);
    push_parts(&mut k, &[tenant, saga, correlation_id]);
    k
}

/// Reads a big-endian `u64` value or key part.
pub(crate) fn u64_of(bytes: &[u8], what: &str) -> Result<u64> {
    let arr: [u8; 8] = bytes
        .try_into()
        .map_err(|_| StorageError::Corrupt(format!("{what}: not 8 bytes")))?;
    Ok(u64::from_be_bytes(arr))
}

/// Decodes a JSON value; `what` names it in the error.
pub(super) fn json<T: for<'de> Deserialize<'de>>(bytes: &[u8], what: &str) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| StorageError::Corrupt(format!("{what}: {e}")))
}

/// Encodes a JSON value.
pub(super) fn to_json<T: Serialize>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| StorageError::Corrupt(format!("encoding: {e}")))
}
