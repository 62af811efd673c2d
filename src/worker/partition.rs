//! The partition of a saga instance: which of the P partitions of SAGA_INBOX its inputs
//! belong to (DESIGN §8.1); the routers use it to pick a copy's partition, the processor to
//! apply only its own partition's keys.
//!
//! **Guarantee.** [`partition`] computes exactly what nats-server's subject transform
//! `{{partition(P,1,2,3)}}` computes when wildcards 1, 2 and 3 of the source subject are the
//! tenant, the saga and the correlation id: FNV-1a 32-bit over the bytes of the three token
//! values written one after the other with no separator, modulo P. So Runner and the server
//! agree on every key: where publishers put the key in subject tokens, the server can
//! partition at ingest and Runner can still tell, for any key, which partition (and so which
//! lease owner) it belongs to. The function depends on nothing but its arguments; it never
//! changes between versions, because changing it would re-map every stored input.
//!
//! **Trap.** With no separator, different keys can hash the same bytes: `("ab", "c", id)`
//! and `("a", "bc", id)` always land in the same partition. That costs balance only, never
//! correctness: a partition holds many keys, and keys stay apart inside it.
//!
//! P is fixed per deployment; changing it moves keys between partitions, which is an
//! offline migration.

/// FNV-1a 32-bit offset basis.
const OFFSET_BASIS: u32 = 0x811c_9dc5;
/// FNV-1a 32-bit prime.
const PRIME: u32 = 0x0100_0193;

/// FNV-1a 32-bit, continued from `hash` over `bytes`.
fn fnv1a32(mut hash: u32, bytes: &[u8]) -> u32 {
    for b in bytes {
        hash ^= u32::from(*b);
        hash = hash.wrapping_mul(PRIME);
    }
    hash
}

/// The partition, in `0..partitions`, of the saga instance keyed by (`tenant`, `saga`,
/// `correlation_id`): the same number nats-server's `{{partition(partitions,1,2,3)}}`
/// transform gives when those are the first three wildcard tokens of the subject.
///
/// # Panics
/// When `partitions` is 0 (configuration guarantees at least one partition).
pub fn partition(tenant: &str, saga: &str, correlation_id: &str, partitions: u32) -> u32 {
    assert!(
        partitions > 0,
        "the number of partitions must be at least 1"
    );
    let hash = [tenant, saga, correlation_id]
        .iter()
        .fold(OFFSET_BASIS, |h, part| fnv1a32(h, part.as_bytes()));
    hash % partitions
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Published FNV-1a 32-bit test vectors (Fowler, Noll and Vo's reference suite).
    #[test]
    fn fnv1a32_matches_the_reference_vectors() {
        assert_eq!(fnv1a32(OFFSET_BASIS, b""), 0x811c_9dc5);
        assert_eq!(fnv1a32(OFFSET_BASIS, b"a"), 0xe40c_292c);
        assert_eq!(fnv1a32(OFFSET_BASIS, b"b"), 0xe70c_2de5);
        assert_eq!(fnv1a32(OFFSET_BASIS, b"foobar"), 0xbf9c_f968);
    }

    #[test]
    fn the_three_values_are_hashed_as_one_concatenation() {
        // "foobar" split anywhere hashes like "foobar" itself.
        let whole = 0xbf9c_f968 % 64;
        assert_eq!(partition("foo", "bar", "", 64), whole);
        assert_eq!(partition("f", "oo", "bar", 64), whole);
        assert_eq!(partition("", "", "foobar", 64), whole);
        // Empty key: the offset basis itself.
        assert_eq!(partition("", "", "", 1 << 31), 0x811c_9dc5 % (1 << 31));
    }

    #[test]
    fn known_keys() {
        assert_eq!(partition("a", "", "", 64), 0xe40c_292c % 64);
        assert_eq!(partition("acme", "order", "order-1", 64), 0x5d78_a611 % 64);
        assert_eq!(partition("acme", "order", "order-1", 64), 17);
        assert_eq!(partition("a", "b", "c", u32::MAX), 0x1a47_e90b);
    }

    #[test]
    fn ab_c_and_a_bc_collide() {
        for p in [2, 7, 64, 1000] {
            assert_eq!(partition("ab", "c", "x", p), partition("a", "bc", "x", p));
        }
    }

    #[test]
    fn always_in_range_and_one_partition_takes_everything() {
        for i in 0..1000 {
            let id = format!("id-{i}");
            assert!(partition("t", "s", &id, 64) < 64);
            assert!(partition("t", "s", &id, 3) < 3);
            assert_eq!(partition("t", "s", &id, 1), 0);
        }
    }

    #[test]
    #[should_panic(expected = "at least 1")]
    fn zero_partitions_is_refused() {
        partition("t", "s", "i", 0);
    }
}
