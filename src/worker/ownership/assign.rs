//! Sticky, balanced assignment of partitions to members (DESIGN §8.5).
//!
//! **Guarantee.** [`assign`] is a pure function of the sorted member list and who holds what
//! now, so every replica that sees the same bucket computes the same target. Each member
//! gets a quota of ⌊P/M⌋ or ⌈P/M⌉ partitions (the first P mod M members in sorted order get
//! the larger one): loads differ by at most one. Current holders keep what they hold up to
//! their quota (sticky: a member joining or leaving moves only the partitions it must); the
//! rest go, in partition order, to members below quota, in member order.
//!
//! The target is only a wish: leases decide who holds a partition. A holder over quota
//! hands partitions over one at a time (by releasing them); a member under quota takes free
//! partitions assigned to it.

use std::collections::{BTreeMap, BTreeSet};

/// The target owner of each partition `0..partitions` (`None` only when there are no
/// members). `members` may be in any order and hold duplicates; `held` maps a partition to
/// the member holding it now.
pub fn assign(
    partitions: u32,
    members: &[String],
    held: &BTreeMap<u32, String>,
) -> Vec<Option<String>> {
    let members: Vec<&String> = members
        .iter()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut target = vec![None; partitions as usize];
    if members.is_empty() {
        return target;
    }
    let m = members.len() as u32;
    let quota = |i: usize| partitions / m + u32::from((i as u32) < partitions % m);
    let index: BTreeMap<&str, usize> = members
        .iter()
        .enumerate()
        .map(|(i, s)| (s.as_str(), i))
        .collect();
    let mut load = vec![0u32; members.len()];
    for p in 0..partitions {
        if let Some(owner) = held.get(&p)
            && let Some(&i) = index.get(owner.as_str())
            && load[i] < quota(i)
        {
            load[i] += 1;
            target[p as usize] = Some(members[i].clone());
        }
    }
    let mut next = 0usize;
    for slot in target.iter_mut() {
        if slot.is_some() {
            continue;
        }
        while load[next] >= quota(next) {
            next += 1;
        }
        load[next] += 1;
        *slot = Some(members[next].clone());
    }
    target
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("r{i}")).collect()
    }

    fn loads(target: &[Option<String>]) -> BTreeMap<String, u32> {
        let mut m = BTreeMap::new();
        for t in target.iter().flatten() {
            *m.entry(t.clone()).or_insert(0) += 1;
        }
        m
    }

    #[test]
    fn balanced_within_one_for_every_size() {
        for p in [1u32, 2, 7, 64, 100] {
            for n in 1..=5 {
                let t = assign(p, &names(n), &BTreeMap::new());
                assert!(t.iter().all(Option::is_some));
                let l = loads(&t);
                let (lo, hi) = (
                    l.values().min().copied().unwrap_or(0),
                    l.values().max().copied().unwrap_or(0),
                );
                assert!(hi - lo <= 1 || (p as usize) < n, "p={p} n={n} {l:?}");
                assert_eq!(l.values().sum::<u32>(), p);
            }
        }
    }

    #[test]
    fn order_of_members_does_not_matter() {
        let mut a = names(3);
        let t1 = assign(64, &a, &BTreeMap::new());
        a.reverse();
        a.push("r1".into());
        assert_eq!(t1, assign(64, &a, &BTreeMap::new()));
    }

    #[test]
    fn a_joining_member_moves_only_what_it_must() {
        let three = assign(64, &names(3), &BTreeMap::new());
        let held: BTreeMap<u32, String> = three
            .iter()
            .enumerate()
            .map(|(p, o)| (p as u32, o.clone().unwrap_or_default()))
            .collect();
        let four = assign(64, &names(4), &held);
        let moved = (0..64).filter(|&p| four[p] != three[p]).count();
        assert_eq!(moved, 16, "the newcomer's share, nothing else");
        assert_eq!(loads(&four).get("r3"), Some(&16));
    }

    #[test]
    fn a_leaving_member_frees_only_its_own() {
        let three = assign(64, &names(3), &BTreeMap::new());
        let held: BTreeMap<u32, String> = three
            .iter()
            .enumerate()
            .filter(|(_, o)| o.as_deref() != Some("r1"))
            .map(|(p, o)| (p as u32, o.clone().unwrap_or_default()))
            .collect();
        let two = assign(64, &["r0".to_string(), "r2".to_string()], &held);
        for p in 0..64 {
            if three[p].as_deref() != Some("r1") {
                assert_eq!(two[p], three[p], "partition {p} moved");
            }
        }
        assert_eq!(
            loads(&two).values().copied().collect::<Vec<_>>(),
            vec![32, 32]
        );
    }

    #[test]
    fn holders_that_left_are_ignored_and_no_members_means_no_target() {
        let held = BTreeMap::from([(0u32, "gone".to_string())]);
        let t = assign(4, &names(2), &held);
        assert!(t.iter().all(|o| o.as_deref() != Some("gone")));
        assert_eq!(assign(4, &[], &held), vec![None; 4]);
    }
}
