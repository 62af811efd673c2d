//! Subject filters as sets of subjects: whether one filter takes in all of another
//! ([`covers`]), whether two can match a common subject ([`overlaps`]), and the narrowest
//! single filter that takes in several ([`widen`]).
//!
//! Filters are NATS-style: tokens split on `.`, `*` matches one token, a final `>` one or
//! more. The answers are exact for filters of that form; none of them allocates except
//! [`widen`], which builds its answer.

/// Whether subject filter `filter` matches every subject that `pattern` matches (for a
/// concrete subject: whether the filter matches it). Allocates nothing: input loops call it
/// for every message they read unfiltered.
pub fn covers(filter: &str, pattern: &str) -> bool {
    let mut p = pattern.split('.');
    for ft in filter.split('.') {
        match (ft, p.next()) {
            (">", Some(_)) => return true,
            (_, None) => return false,
            ("*", Some(pt)) => {
                if pt == ">" {
                    return false;
                }
            }
            (lit, Some(pt)) => {
                if lit != pt {
                    return false;
                }
            }
        }
    }
    p.next().is_none()
}

/// Whether some subject matches both `a` and `b`.
pub fn overlaps(a: &str, b: &str) -> bool {
    let (mut a, mut b) = (a.split('.'), b.split('.'));
    loop {
        match (a.next(), b.next()) {
            (None, None) => return true,
            // `>` takes one token or more, and the other has one here.
            (Some(">"), Some(_)) | (Some(_), Some(">")) => return true,
            (Some(x), Some(y)) if x == "*" || y == "*" || x == y => {}
            _ => return false,
        }
    }
}

/// The narrowest single filter (of the form above) matching every subject that any of
/// `filters` matches: token by token, a literal all of them share stays, any other
/// becomes `*`; filters of different lengths, or one with `>`, end in `>` from the first
/// place they cannot all be matched token by token. `None` for no filters.
pub fn widen<S: AsRef<str>>(filters: &[S]) -> Option<String> {
    let split: Vec<Vec<&str>> = filters
        .iter()
        .map(|f| f.as_ref().split('.').collect())
        .collect();
    let shortest = split.iter().map(Vec::len).min()?;
    let same_length = split.iter().all(|t| t.len() == shortest);
    let mut out: Vec<&str> = Vec::with_capacity(shortest);
    for i in 0..shortest {
        let tokens = || split.iter().map(|t| t[i]);
        // A tail: `>` here, or the last common place of filters that go on differently.
        if tokens().any(|t| t == ">") || (!same_length && i + 1 == shortest) {
            out.push(">");
            return Some(out.join("."));
        }
        let first = split[0][i];
        out.push(if tokens().all(|t| t == first) {
            first
        } else {
            "*"
        });
    }
    Some(out.join("."))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subject_coverage() {
        assert!(covers("tenant.*.aggregate.*.*", "tenant.*.aggregate.*.*"));
        assert!(covers("tenant.>", "tenant.*.aggregate.*.*"));
        assert!(covers(">", "runner.inbox.>"));
        assert!(!covers(
            "tenant.acme.aggregate.*.*",
            "tenant.*.aggregate.*.*"
        ));
        assert!(!covers("tenant.*.aggregate.*", "tenant.*.aggregate.*.*"));
        assert!(!covers("runner.inbox.*", "runner.inbox.>"));
    }

    #[test]
    fn overlap() {
        assert!(overlaps(
            "tenant.*.aggregate.>",
            "tenant.*.aggregate.Order.*"
        ));
        assert!(overlaps("tenant.*.>", "tenant.acme.effect_result.x.y"));
        assert!(overlaps("tenant.acme.*", "tenant.*.x"));
        assert!(!overlaps(
            "tenant.*.aggregate.>",
            "tenant.*.effect_result.*.*"
        ));
        assert!(!overlaps("tenant.*.aggregate.>", "tenant.*.aggregate"));
        assert!(!overlaps("a.b", "a.b.c"));
        assert!(!overlaps("runner.fence.S.*", "tenant.*.>"));
        assert!(overlaps("a.b", "a.b"));
    }

    #[test]
    fn widening() {
        assert_eq!(widen::<&str>(&[]), None);
        assert_eq!(
            widen(&["tenant.*.aggregate.Order.*"]).as_deref(),
            Some("tenant.*.aggregate.Order.*")
        );
        assert_eq!(
            widen(&[
                "tenant.*.effect_result.charge_card.*",
                "tenant.*.effect_result.refund_card.*"
            ])
            .as_deref(),
            Some("tenant.*.effect_result.*.*")
        );
        assert_eq!(
            widen(&["tenant.*.aggregate.Order.*", "tenant.*.aggregate.Order.x.y"]).as_deref(),
            Some("tenant.*.aggregate.Order.>")
        );
        assert_eq!(
            widen(&["tenant.*.aggregate.>", "tenant.*.aggregate.Order.*"]).as_deref(),
            Some("tenant.*.aggregate.>")
        );
        assert_eq!(widen(&["a.b", "a"]).as_deref(), Some(">"));
        // Whatever the mix, every filter given is covered by the answer.
        let mixes: [&[&str]; 4] = [
            &["tenant.*.effect_result.a.*", "tenant.*.workflow_event.b.*"],
            &["tenant.*.x.>", "tenant.acme.x.y"],
            &["a.b.c", "a.b", "a.b.c.d"],
            &["x.*", "y.>"],
        ];
        for mix in mixes {
            let w = widen(mix).expect("some filters");
            for f in mix {
                assert!(covers(&w, f), "{w} covers {f}");
            }
        }
    }
}
