//! Two maps compared key by key, each difference described: how the projection checks report.

use std::collections::{BTreeMap, BTreeSet};

/// The keys whose values differ (a key missing on one side counts as `zero` there), described.
pub(super) fn differences<K: Ord + std::fmt::Display, V: PartialEq + std::fmt::Debug>(
    expected: &BTreeMap<K, V>,
    found: &BTreeMap<K, V>,
    zero: V,
) -> Vec<String> {
    let keys: BTreeSet<&K> = expected.keys().chain(found.keys()).collect();
    keys.into_iter()
        .filter_map(|key| {
            let want = expected.get(key).unwrap_or(&zero);
            let have = found.get(key).unwrap_or(&zero);
            (want != have)
                .then(|| format!("{key}: the fold says {want:?}, the projection {have:?}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_count_a_missing_key_as_zero_and_name_what_differs() {
        let expected = BTreeMap::from([("a", 1), ("b", 0), ("c", 3)]);
        let found = BTreeMap::from([("a", 1), ("c", 4), ("d", 0)]);
        let differing = differences(&expected, &found, 0);
        assert_eq!(differing.len(), 1, "{differing:?}");
        assert!(differing[0].starts_with("c:"), "{differing:?}");
    }
}
